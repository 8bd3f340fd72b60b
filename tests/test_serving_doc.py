"""docs/serving.md runs as written (issue 26, item 6): its bash blocks start the service in process and across real
party processes and call it with curl, in a fresh directory (holding the repository's scripts/), its ```toml
file=PATH blocks written to those paths (ports replaced by free ones); the outputs it shows are what the commands
print."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from test_own_data_doc import run_documented, script_and_files, unmatched

pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "serving.md"
DOC_PORTS = ("50061", "50062", "50063", "8080", "8081")


@pytest.mark.float_sensitive
@pytest.mark.slow
def test_the_serving_page_runs_as_documented(tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("the page calls the service with curl")
    script, files, shown = script_and_files(DOC)
    assert "partialvfl serve --model" in script and "--federation" in script and len(files) == 4
    out = run_documented(tmp_path, script, files, DOC_PORTS, timeout=900)
    missing = unmatched(shown, out.splitlines())
    assert not missing, f"the doc shows lines the commands did not print: {missing[:5]}\n{out[-3000:]}"
