"""The built-in environments driven directly, turn by turn, with hand-written model turns (no model)."""

from __future__ import annotations

import os
import re
import time

import pytest

from graphrl.envs import ENVS, class_mismatch, env_class, step_result
from graphrl.envs.calculator import (
    MAX_EXPONENT,
    CalcError,
    Calculator,
    evaluate,
    format_number,
)
from graphrl.envs.games import DIGIT_WORDS, DigitEcho, digit_ids, digit_text
from graphrl.envs.python_tool import FILE_LIMIT_BYTES, PythonTool, run_python
from graphrl.tasks import BOS, EOS, PAD, SEP

ROW = {"prompt": "Tom has 12 boxes of 7 pens and 3 loose pens. How many pens?", "answer": "87", "system": None,
       "index": 0}


def test_builtins_are_registered_and_fit_the_protocol() -> None:
    for name, cls in (("calculator", Calculator), ("python", PythonTool), ("digit-echo", DigitEcho)):
        assert env_class(name) is cls
        assert class_mismatch(cls, {}) is None
    assert {"calculator", "python", "digit-echo"} <= set(ENVS.names())


# Calculator


@pytest.mark.parametrize(("expression", "shown"), [
    ("12*7+3", "87"),
    ("(12 + 3) * 2", "30"),
    ("7 / 2", "3.5"),
    ("8 / 2", "4"),                 # a whole float is shown without .0
    ("1 / 3", "0.333333333333"),
    ("7 // 2", "3"),
    ("-7 % 3", "2"),
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),
    ("-(+3)", "-3"),
    ("1,234 + 1", "1235"),          # thousands separators, as word problems write them
    ("0.1 + 0.2", "0.3"),
])
def test_calculator_evaluates_arithmetic(expression: str, shown: str) -> None:
    assert format_number(evaluate(expression)) == shown


@pytest.mark.parametrize(("expression", "reason"), [
    ("__import__('os').system('true')", "function calls"),
    ("x + 1", "unknown name 'x'"),
    ("(1).real", "unsupported attribute"),
    ("'a' * 3", "unsupported value"),
    ("True + 1", "unsupported value"),
    ("[1, 2]", "unsupported list"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    (f"2 ** {MAX_EXPONENT + 1}", "exponent too large"),
    ("9 ** 9 ** 9", "exponent too large"),
    ("10 ** 31", "result too large"),
    ("1e300 * 1e300", "result too large"),
    ("(-8) ** 0.5", "not a real number"),
    ("2 ^ 3", "use ** for powers"),
    ("1 +", "invalid expression"),
    ("", "empty expression"),
    ("1+" * 150 + "1", "longer than"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression: str, reason: str) -> None:
    with pytest.raises(CalcError, match=re.escape(reason)):
        evaluate(expression)


def test_calculator_episode_calls_then_answers() -> None:
    env = Calculator()
    prompt = env.reset(ROW)
    assert prompt.startswith(ROW["prompt"]) and "<calc>" in prompt and "final answer" in prompt
    assert env.step("Pens in boxes: <calc>12*7</calc> then more") == ("Result: 84", 0.0, False)
    observation, reward, done = env.step("<calc>84 + three</calc>")
    assert observation.startswith("error: unknown name 'three'") and (reward, done) == (0.0, False)
    assert env.step("<calc>84+3") == ("Result: 87", 0.0, False)  # generation stopped at the closing tag
    assert env.step("So he has 87 pens.") == (None, 1.0, True)
    assert (env.tool_calls, env.tool_errors) == (3, 1)
    step_result(env.step("88"))  # the protocol's own check accepts what step returns


def test_calculator_scores_wrong_and_missing_answers() -> None:
    env = Calculator()
    env.reset(ROW)
    assert env.step("It is 86.") == (None, 0.0, True)
    env = Calculator()
    env.reset({**ROW, "answer": None})
    assert env.step("It is 87.") == (None, 0.0, True)
    env = Calculator()
    env.reset({**ROW, "answer": "#### 87"})
    assert env.step("The answer is \\boxed{87.0}") == (None, 1.0, True)


def test_calculator_limits_calls_and_takes_its_options() -> None:
    env = Calculator(instructions="Use [[x]].", tag="c", max_calls=1)
    assert env.reset(ROW).endswith("\n\nUse [[x]].")
    assert env.step("<calc>1+1</calc> is ignored, <c>1+1</c>") == ("Result: 2", 0.0, False)
    observation, _, done = env.step("<c>2+2</c>")
    assert "no calculator calls left" in observation and "final answer" in observation and not done
    assert (env.tool_calls, env.tool_errors) == (2, 1)
    with pytest.raises(ValueError, match="tag"):
        Calculator(tag="<calc>")


# Python


def _python_env(**options: object) -> PythonTool:
    env = PythonTool(**{"timeout_s": 2.0, **options})
    env.reset(ROW)
    return env


def test_python_runs_a_block_and_scores_the_answer() -> None:
    env = PythonTool()
    prompt = env.reset(ROW)
    assert prompt.startswith(ROW["prompt"]) and "```python" in prompt
    assert env.step("Let me compute.\n```python\nprint(12 * 7 + 3)\n```\n") == ("Output:\n87", 0.0, False)
    assert env.step("```python\nx = 1\n```") == ("Output:\n(no output)", 0.0, False)
    assert env.step("He has 87 pens.") == (None, 1.0, True)
    assert (env.tool_calls, env.tool_errors) == (2, 0)


def test_python_reports_errors_and_truncates_output() -> None:
    env = _python_env()
    observation, reward, done = env.step("```python\nprint('before')\n1 / 0\n```")
    assert observation.startswith("error: exit status 1\nbefore\n") and (reward, done) == (0.0, False)
    assert 'File "main.py", line 2' in observation and observation.endswith("ZeroDivisionError: division by zero")
    assert (env.tool_calls, env.tool_errors) == (1, 1)
    env = _python_env(max_output_chars=100)
    observation, _, _ = env.step("```python\nprint('a' * 5000 + 'END')\n```")
    assert observation.startswith("Output:\naaa") and observation.endswith("aaaEND") and "characters cut" in observation
    assert len(observation) < 200
    assert (env.tool_calls, env.tool_errors) == (1, 0)


def test_python_stops_an_infinite_loop() -> None:
    env = _python_env(timeout_s=0.5)
    observation, reward, done = env.step("```python\nprint('spinning', flush=True)\nwhile True:\n    pass\n```")
    assert observation == "error: timed out after 0.5 s\nspinning"
    assert (reward, done, env.tool_errors) == (0.0, False, 1)


def test_python_memory_is_limited() -> None:
    env = _python_env(memory_mb=256)
    observation, _, _ = env.step("```python\nblock = bytearray(2 * 1024 ** 3)\nprint(len(block))\n```")
    assert observation.startswith("error: exit status 1") and "MemoryError" in observation
    assert env.tool_errors == 1


def test_python_sees_no_variable_of_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHRL_SECRET_TEST", "hunter2")
    env = _python_env()
    observation, _, _ = env.step("```python\nimport os\nprint(sorted(os.environ))\n"
                                 "print(os.environ.get('GRAPHRL_SECRET_TEST'))\n```")
    names, secret = observation.removeprefix("Output:\n").splitlines()
    assert secret == "None" and "HOME" not in names and "PATH" in names


def test_python_files_land_in_a_scratch_directory_that_is_removed() -> None:
    code = "import os\nopen('notes.txt', 'w').write('x')\nprint(os.path.abspath('notes.txt'))"
    outcome = run_python(code, timeout_s=2.0, memory_mb=256, max_output_chars=600)
    path = outcome.observation.removeprefix("Output:\n")
    assert outcome.ok and path.endswith("notes.txt") and os.path.dirname(path) != os.getcwd()
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))


def test_python_limits_file_size_and_calls() -> None:
    env = _python_env(max_calls=1)
    observation, _, _ = env.step("```python\nopen('big', 'wb').write(b'x' * (4 << 20))\n```")
    assert "File too large" in observation
    observation, _, done = env.step("```py\nprint(1)\n```")
    assert "no Python runs left" in observation and not done
    assert (env.tool_calls, env.tool_errors) == (2, 2)


def test_python_runs_under_resource_limits() -> None:
    code = ("import resource as r\n"
            "for name in ('RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_NPROC', 'RLIMIT_CPU'):\n"
            "    print(name, *r.getrlimit(getattr(r, name)))")
    outcome = run_python(code, timeout_s=2.0, memory_mb=300, max_output_chars=600)
    limits = dict(line.split(" ", 1) for line in outcome.observation.removeprefix("Output:\n").splitlines())
    assert limits == {"RLIMIT_AS": f"{300 << 20} {300 << 20}", "RLIMIT_FSIZE": f"{FILE_LIMIT_BYTES} {FILE_LIMIT_BYTES}",
                      "RLIMIT_NPROC": "0 0", "RLIMIT_CPU": "3 4"}


@pytest.mark.skipif(os.geteuid() == 0, reason="Linux does not limit root's processes (RLIMIT_NPROC)")
def test_python_cannot_start_processes() -> None:
    outcome = run_python("import os\nos.fork()\nprint('forked')", timeout_s=2.0, memory_mb=256, max_output_chars=600)
    assert not outcome.ok and "forked" not in outcome.observation


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="only root's code can start a process to leave behind")
def test_python_leaves_no_process_behind() -> None:
    """A process the code starts in the background is killed with the code's process group when the call ends."""
    code = "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\nprint(pid)"
    outcome = run_python(code, timeout_s=2.0, memory_mb=256, max_output_chars=600)
    pid = int(outcome.observation.removeprefix("Output:\n"))
    for _ in range(200):  # SIGKILL is sent; wait (at most 2 s) until the kernel has ended the process
        if not _alive(pid):
            break
        time.sleep(0.01)
    assert not _alive(pid)


# Digit echo


def test_digit_codec_round_trips_and_refuses_unknown_words() -> None:
    ids = [BOS, 3, 5, 1, 2, SEP, EOS, PAD]
    assert digit_text(ids) == "<bos> 3 5 1 2 <sep> <eos> <pad>"
    assert digit_ids(digit_text(ids)) == ids
    assert digit_ids("  0 9\n<sep> ") == [0, 9, SEP]
    assert DIGIT_WORDS == {10: "<bos>", 11: "<sep>", 12: "<eos>", 13: "<pad>"}
    for text in ("12", "<BOS>", "3,", "x"):
        with pytest.raises(ValueError, match="not a word"):
            digit_ids(text)
    with pytest.raises(ValueError, match="no word"):
        digit_text([14])


def test_digit_echo_rotates_the_target_and_sums_to_one() -> None:
    env = DigitEcho(turns=3)
    assert env.reset({"prompt": "<bos> 3 5 1 2 <sep>", "answer": None, "system": None, "index": 0}) is None
    assert env.step("3 5 1 2 <eos>") == ("<bos> 5 1 2 3 <sep>", pytest.approx(1 / 3), False)
    assert env.step("5 1 2 3") == ("<bos> 1 2 3 5 <sep>", pytest.approx(1 / 3), False)
    assert env.step("1 2 3 5") == (None, pytest.approx(1 / 3), True)
    assert (env.tool_calls, env.tool_errors) == (0, 0)


@pytest.mark.parametrize(("text", "reward"), [
    ("3 5 1 2", 0.5),
    ("3 5 9 9", 0.25),       # half the positions right
    ("3 5", 0.25),           # missing digits count wrong
    ("3 5 1 2 7 7", 0.5),    # extra digits earn nothing
    ("5 1 2", 0.0),          # shifted: every position wrong
    ("hello there", 0.0),
    ("", 0.0),
])
def test_digit_echo_scores_positions(text: str, reward: float) -> None:
    env = DigitEcho(turns=2)
    env.reset({"prompt": "<pad> <bos> 3 5 1 2 <sep>", "answer": None, "system": None, "index": 0})
    observation, got, done = env.step(text)
    assert got == pytest.approx(reward) and observation == "<bos> 5 1 2 3 <sep>" and not done


def test_digit_echo_refuses_bad_options_and_prompts() -> None:
    with pytest.raises(ValueError, match="turns"):
        DigitEcho(turns=0)
    with pytest.raises(ValueError, match="no digits"):
        DigitEcho().reset({"prompt": "<bos> <sep>", "answer": None, "system": None, "index": 0})
