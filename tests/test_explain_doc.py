"""docs/explain.md runs as written: its bash and Python blocks in order, in a fresh directory (holding the repository's
scripts/), its ```toml file=PATH blocks written there (ports replaced by free ones): explanations and party values of
the own-data example in process and across real party processes, a bar chart and a reliability diagram written,
``POST /v1/explain`` answered with curl; the outputs it shows are what the commands print (the federated model's
figures, which vary by deployment, compared without their decimals)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from test_own_data_doc import run_documented, script_and_files, unmatched

pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "explain.md"
DOC_PORTS = ("50071", "50072", "50073", "8090")


@pytest.mark.float_sensitive
@pytest.mark.slow
def test_the_explanations_page_runs_as_documented(tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("the page calls the service with curl")
    script, files, shown = script_and_files(DOC)
    assert "partialvfl explain --federation" in script and "partialvfl value --federation" in script
    assert "/v1/explain" in script and len(files) == 4
    out = run_documented(tmp_path, script, files, DOC_PORTS, timeout=1200)
    missing = unmatched(shown, out.splitlines())
    assert not missing, f"the doc shows lines the commands did not print: {missing[:5]}\n{out[-3000:]}"
    # in process == federated, bit for bit on the machine the page was made on; 1e-6 elsewhere (a row's place in a
    # batch can move a product's last bit on another processor's kernels: test_own_data_doc.py)
    found = re.search(r"^\d+ customers; largest difference: (\S+)$", out, re.M)
    assert found and float(found.group(1)) <= 1e-6, out[-2000:]
    for name in ("values/values.png", "values/values.svg", "fed-values/values.png", "reliability.png"):
        assert (tmp_path / "example" / name).stat().st_size > 1000, name
