"""Write ``docs/messages.md`` from the message declarations of every party program (with its declared set-up config)
and of the built-ins.

    python scripts/message_docs.py           # rewrite the file
    python scripts/message_docs.py --check   # exit 1 if the file is out of date (tests/test_schema.py does this)
"""

from __future__ import annotations

import sys
from pathlib import Path

from partialvfl.federation.grpc.party import SERVER_MESSAGES
from partialvfl.federation.trust.psu import PSU_MESSAGES
from partialvfl.federation.wire.program import PROGRAMS, RUNTIME_MESSAGES
from partialvfl.federation.wire.schema import messages_markdown
from partialvfl.federation.wire.setup_config import setup_config_markdown
from partialvfl.methods.registry import METHODS, load_all

DOC = Path(__file__).resolve().parents[1] / "docs" / "messages.md"


def render() -> str:
    """The text of ``docs/messages.md``: the library's programs (not test or plugin programs), then the built-ins."""
    load_all()  # imports every method's implementation, which registers its party program
    sections = []
    for name, cls in sorted(PROGRAMS.items()):
        if not cls.__module__.startswith("partialvfl."):
            continue
        users = sorted(m for m, c in METHODS.items() if c.party_program == name)
        about = f"`{cls.__module__}.{cls.__qualname__}`, used by {', '.join(users)}."
        if cls.setup_config is not None:
            about += "\n\n" + "\n".join([
                f"Set-up config (`{cls.setup_config.__module__}.{cls.setup_config.__qualname__}`): the `config` of "
                "its `setup` request, read once on arrival; a key it does not declare, a missing one or a value "
                "outside its type or range is refused, naming the key and the value.", "",
                "| key | accepts | default | meaning |", "|---|---|---|---|", *setup_config_markdown(cls.setup_config)])
        sections.append((f"`{name}`", about, cls.messages, True))
    sections.append(("Built-in kinds of every party", "`partialvfl.federation.wire.program.RUNTIME_MESSAGES`, "
                     "answered by the runtime in process and behind the gRPC server.", RUNTIME_MESSAGES, False))
    sections.append(("Built-in kinds of the gRPC party server", "`partialvfl.federation.grpc.party.SERVER_MESSAGES`.",
                     SERVER_MESSAGES, False))
    sections.append(("Alignment kinds of the gRPC party server", "`partialvfl.federation.trust.psu.PSU_MESSAGES` (the "
                     "keyless alignment, the default; docs/deployment.md, \"Alignment\").", PSU_MESSAGES, False))
    return messages_markdown(sections)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python scripts/message_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
