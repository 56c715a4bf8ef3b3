"""The front ends agree: YAML and the Python builder give the same job, and every rendering of it is usable.

- `examples/grpo_tiny.py` builds the job `examples/grpo_tiny.yaml` describes (spec and graph equal);
- the builder refuses a reference to an output port that does not exist, naming the valid ones;
- every example validates;
- `graphrl graph --format dot` is DOT that Graphviz renders (structure checked even without Graphviz);
- `graphrl graph --format json` carries the node specs, which rebuild the job's nodes;
- `graphrl schema` equals the checked-in `graphrl.schema.json`, and that schema accepts every example.
"""

from __future__ import annotations

import json
import re
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result
from pydantic import TypeAdapter

from graphrl.builder import Job
from graphrl.cli import main
from graphrl.errors import JobError
from graphrl.ir import build_graph
from graphrl.loader import load_job
from graphrl.schemas.job import JobSpec, NodeSpec

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
EXAMPLE_JOBS = sorted(p.name for p in EXAMPLES.glob("*.yaml")) + sorted(p.name for p in EXAMPLES.glob("*.py"))


def missing_checkpoint(name: str) -> str | None:
    """A checkpoint the example names that is made locally (examples/arith/make_arith_data.py --model)."""
    if not name.endswith(".yaml"):
        return None
    import yaml

    for model in yaml.safe_load((EXAMPLES / name).read_text()).get("models", {}).values():
        if model.get("checkpoint") and not (EXAMPLES / model["checkpoint"]).exists():
            return model["checkpoint"]
    return None


def cli(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, f"graphrl {' '.join(args)} exited {result.exit_code}:\n{result.output}"
    return result


# -- Python API == YAML ----------------------------------------------------------------------------

def test_python_job_equals_yaml_job() -> None:
    built = runpy.run_path(str(EXAMPLES / "grpo_tiny.py"))["build_job"]()
    loaded = load_job(EXAMPLES / "grpo_tiny.yaml").spec
    assert isinstance(built, JobSpec)
    assert built == loaded
    assert build_graph(built) == build_graph(loaded)


def test_python_job_differs_when_the_yaml_does() -> None:
    """The equality above is not vacuous: one changed setting makes the specs differ."""
    built = runpy.run_path(str(EXAMPLES / "grpo_tiny.py"))["build_job"]()
    text = (EXAMPLES / "grpo_tiny.yaml").read_text().replace("samples_per_prompt: 16", "samples_per_prompt: 4")
    from graphrl.loader import load_job_text

    assert "samples_per_prompt: 4" in text
    assert built != load_job_text(text).spec


def test_builder_refuses_unknown_output_port() -> None:
    job = Job("t")
    prompts = job.dataset("prompts", task="digits-copy", batch_size=4, prompt_len=6)
    with pytest.raises(JobError) as info:
        prompts.out("prompt")
    assert "no output port 'prompt'" in info.value.message
    assert info.value.path == ("nodes", "prompts")
    assert info.value.fix is not None and "prompts" in info.value.fix
    assert str(prompts.out("prompts")) == "prompts.prompts"


def test_python_job_with_a_mistake_is_a_located_user_error(tmp_path: Path) -> None:
    """A builder error inside build_job() reaches the terminal as our two-line error, exit 2, at the line
    of the script that made it. (build_job() used to run outside the error handling, so the message
    named no file at all.)"""
    script = tmp_path / "bad_job.py"
    script.write_text(
        "from graphrl.builder import Job\n"
        "def build_job():\n"
        "    job = Job('t')\n"
        "    prompts = job.dataset('prompts', task='digits-copy', batch_size=4, prompt_len=6)\n"
        "    prompts.out('prompt')\n"
    )
    result = CliRunner().invoke(main, ["validate", str(script)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.startswith(f"error: {script}:5: nodes.prompts: ")
    assert "no output port 'prompt'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 2


def test_python_job_raising_a_pydantic_error_is_one_line(tmp_path: Path) -> None:
    """A ValidationError from a builder call is reported in one line (pydantic's own text spans many)."""
    script = tmp_path / "bad_lr.py"
    script.write_text("from graphrl.builder import Job\n\ndef build_job():\n    Job('t').algorithm(lr=-1)\n")
    result = CliRunner().invoke(main, ["validate", str(script)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"error: {script}:4: ") and "lr: Input should be greater than 0" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("  fix: ")


# -- every example validates -----------------------------------------------------------------------

@pytest.mark.parametrize("name", EXAMPLE_JOBS)
def test_example_validates(name: str) -> None:
    if (missing := missing_checkpoint(name)) is not None:
        pytest.skip(f"{name} needs examples/{missing}; make it with examples/arith/make_arith_data.py --model")
    result = cli("validate", str(EXAMPLES / name))
    assert result.stdout.startswith(f"ok: {EXAMPLES / name}: job ")


# -- DOT -------------------------------------------------------------------------------------------

def _dot() -> str:
    return cli("graph", "--format", "dot", str(EXAMPLES / "ppo_tiny.yaml")).stdout


def test_dot_is_structurally_valid() -> None:
    """Without Graphviz: one digraph, balanced braces and quotes, every edge between declared nodes."""
    text = _dot()
    lines = text.strip().splitlines()
    assert re.fullmatch(r'digraph "ppo_tiny" \{', lines[0]) and lines[-1] == "}"
    assert text.count("{") == text.count("}")
    body = lines[1:-1]
    assert all(line.endswith(";") and line.count('"') % 2 == 0 for line in body), body
    declared = {m[1] for line in body if (m := re.fullmatch(r'\s*"([^"]+)" \[label=.*\];', line))}
    edges = [re.fullmatch(r'\s*"([^"]+)" -> "([^"]+)" \[.*\];', line) for line in body if "->" in line]
    assert all(edges)
    job = load_job(EXAMPLES / "ppo_tiny.yaml").spec
    assert declared == set(job.nodes)
    assert {m[1] for m in edges} | {m[2] for m in edges} <= declared
    graph = json.loads(cli("graph", "--format", "json", str(EXAMPLES / "ppo_tiny.yaml")).stdout)
    assert len(edges) == len(graph["edges"])
    assert sum("style=dashed" in line for line in body) == sum(e["kind"] == "weight" for e in graph["edges"])


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed (apt-get install graphviz)")
def test_dot_renders_with_graphviz() -> None:
    proc = subprocess.run(["dot", "-Tsvg"], input=_dot(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "<svg" in proc.stdout and proc.stderr.strip() == "", proc.stderr
    # Every node's name is drawn.
    for name in load_job(EXAMPLES / "ppo_tiny.yaml").spec.nodes:
        assert f">{name}</text>" in proc.stdout


# -- JSON ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["grpo_tiny.yaml", "ppo_tiny.yaml"])
def test_graph_json_round_trips(name: str) -> None:
    text = cli("graph", "--format", "json", str(EXAMPLES / name)).stdout
    data = json.loads(text)
    assert json.loads(json.dumps(data)) == data
    job = load_job(EXAMPLES / name).spec
    assert data["job"] == job.name
    # The node specs rebuild the job's nodes exactly, in declaration order.
    adapter = TypeAdapter(NodeSpec)
    assert [n["name"] for n in data["nodes"]] == list(job.nodes)
    for node in data["nodes"]:
        assert adapter.validate_python(node["spec"]) == job.nodes[node["name"]]
    # The data edges are exactly the job's input references.
    refs = {(dst, port, ref) for dst, spec in job.nodes.items() for port, ref in spec.inputs.items()}
    edges = {(e["dst"], e["dst_port"], f"{e['src']}.{e['src_port']}") for e in data["edges"] if e["kind"] == "data"}
    assert edges == refs


# -- JSON Schema -----------------------------------------------------------------------------------

def test_schema_command_matches_checked_in_file(tmp_path: Path) -> None:
    """`graphrl.schema.json` (which editors use through the examples' yaml-language-server line) is current.
    Regenerate it with `graphrl schema -o graphrl.schema.json`."""
    checked_in = (REPO / "graphrl.schema.json").read_text()
    assert cli("schema").stdout == checked_in.rstrip("\n") + "\n"
    out = tmp_path / "schema.json"
    cli("schema", "-o", str(out))
    assert out.read_text() == checked_in


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_examples_match_the_json_schema(name: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "graphrl.schema.json").read_text())
    jsonschema.validate(yaml.safe_load((EXAMPLES / name).read_text()), schema)
    # ...and the schema does reject something: an unknown top-level key.
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**yaml.safe_load((EXAMPLES / name).read_text()), "step": 1}, schema)
