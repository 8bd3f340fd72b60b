"""docs/serving.md runs as written (issue 26, item 6): its bash blocks start the service in process and across real
party processes and call it with curl, in a fresh directory (holding the repository's scripts/), its ```toml
file=PATH blocks written to those paths (ports replaced by free ones); the outputs it shows are what the commands
print."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_own_data_doc import free_ports, script_and_files

pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "serving.md"
DOC_PORTS = ("50061", "50062", "50063", "8080", "8081")


def test_the_serving_page_runs_as_documented(tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("the page calls the service with curl")
    script, files, shown = script_and_files(DOC)
    assert "partialvfl serve --model" in script and "--federation" in script and len(files) == 4
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "make_example_tables.py", tmp_path / "scripts")
    ports = dict(zip(DOC_PORTS, map(str, free_ports(len(DOC_PORTS)))))  # the doc's ports may be taken here
    for doc_port, port in ports.items():
        script = script.replace(f":{doc_port}", f":{port}").replace(f"--port {doc_port}", f"--port {port}")
    for name, text in files.items():
        for doc_port, port in ports.items():
            text = text.replace(f":{doc_port}", f":{port}")
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", "PARTIALVFL_EXIT_WITH_PARENT": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    printed = set(out.splitlines())
    missing = [line for line in shown if line.strip() and line not in printed]
    assert not missing, f"the doc shows lines the commands did not print: {missing[:5]}\n{out[-3000:]}"
