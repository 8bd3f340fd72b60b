"""How a fit runs, as opposed to what it learns: the run options of a method, one typed, frozen object.

A method's knobs come through two channels and no other: its declared parameters (:mod:`partialvfl.methods.params`;
the command line's ``--param NAME=VALUE``, a grid's values, label DP and the party-DP options of
:data:`~partialvfl.methods.params.PRIVACY_PARAMS`), and these run options, each with its own type and its own
command-line flag (``--device``, ``--precision``, ``--compile``, ``--quiet`` / ``--log-epochs``).  A model fitted
on a GPU in bf16 is the same model as one fitted on the CPU: run options are not parameters, are not saved with the
model, and ``--param`` does not reach them (:func:`refuse_run_option` says which flag does).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from partialvfl.methods.params import parse_bool
from partialvfl.utils.progress import PROGRESS_MODES

__all__ = ["RUN_OPTION_FLAGS", "RunOptions", "refuse_run_option"]


@dataclass(frozen=True)
class RunOptions:
    """``progress``: ``True`` shows a bar over the epochs when stderr is a terminal (nothing per epoch when it is
    not), ``"epochs"`` one line per epoch (its metrics), ``False`` nothing; ``device``: where the coordinator (and
    in-process parties) compute (``"cpu"``, ``"cuda:0"``, ``"auto"``, a ``torch.device``); ``precision``: ``fp32``
    or ``bf16``; ``compile``: ``torch.compile`` the hot steps.  Checked when made (one line naming the option);
    ``torch_device`` is ``device`` resolved."""

    progress: bool | str = False
    device: Any = "cpu"
    precision: str = "fp32"
    compile: bool = False  # torch's word
    torch_device: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from partialvfl.utils.devices import check_precision, resolve_device

        if not (isinstance(self.progress, bool) or self.progress in PROGRESS_MODES):
            raise ValueError(f"progress must be True, False or 'epochs', got {self.progress!r}")
        object.__setattr__(self, "precision", check_precision(self.precision, what="precision"))
        object.__setattr__(self, "compile", parse_bool(self.compile, "compile"))
        object.__setattr__(self, "torch_device", resolve_device(self.device, what="device"))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The run options' names (the keywords of a method's constructor that set them)."""
        return tuple(f.name for f in fields(cls) if f.init)


#: where each run option (and the method's preset and seed, which ``fit`` takes as flags too) is set on the command
#: line: ``--param`` does not reach them
RUN_OPTION_FLAGS = {"preset": "--preset", "seed": "--seed", "progress": "--quiet or --log-epochs",
                    "device": "--device", "precision": "--precision", "compile": "--compile",
                    "label_dp": "--label-dp"}


def refuse_run_option(names: Any) -> None:
    """A ``ValueError`` (one line) for the first of ``names`` that has its own flag, naming that flag."""
    for name in names:
        key = str(name).strip().replace("-", "_")
        if key in RUN_OPTION_FLAGS:
            what = "the label DP epsilon" if key == "label_dp" else (
                "a run option (how the fit runs, not what it learns)" if key in RunOptions.names() else
                f"the method's {key}")
            raise ValueError(f"--param {name}: {key} is {what}, not a --param; use {RUN_OPTION_FLAGS[key]}")
