"""The built-in environments, registered by the names a job's `env.class` uses."""

from __future__ import annotations

from graphrl.envs import ENVS
from graphrl.envs.calculator import Calculator
from graphrl.envs.games import DigitEcho
from graphrl.envs.python_tool import PythonTool

ENVS.add("calculator", Calculator)
ENVS.add("python", PythonTool)
ENVS.add("digit-echo", DigitEcho)
