"""Pydantic models of everything a user writes (job, cluster, hardware, model) and of the compiled plan.

All models are frozen and forbid unknown keys, so a typo is an error and a pass can never mutate its
input. `graphrl schema` emits the JSON Schema of `JobSpec` for editors.
"""

from graphrl.schemas.base import Frozen
from graphrl.schemas.cluster import CLUSTER_PRESETS, ClusterSpec
from graphrl.schemas.data import DataSchema, TensorField
from graphrl.schemas.hardware import HARDWARE_PRESETS, HardwareSpec
from graphrl.schemas.job import (
    AdvantageNode,
    AlgorithmSpec,
    DatasetNode,
    GenerateNode,
    JobSpec,
    LogprobNode,
    NodeSpec,
    PlacementHints,
    RewardNode,
    RoleHint,
    RunSettings,
    ScheduleSpec,
    TrainNode,
    ValueNode,
)
from graphrl.schemas.model import MODEL_PRESETS, ModelDims, ModelSpec

__all__ = [
    "AdvantageNode",
    "AlgorithmSpec",
    "CLUSTER_PRESETS",
    "ClusterSpec",
    "DataSchema",
    "DatasetNode",
    "Frozen",
    "GenerateNode",
    "HARDWARE_PRESETS",
    "HardwareSpec",
    "JobSpec",
    "LogprobNode",
    "MODEL_PRESETS",
    "ModelDims",
    "ModelSpec",
    "NodeSpec",
    "PlacementHints",
    "RewardNode",
    "RoleHint",
    "RunSettings",
    "ScheduleSpec",
    "TensorField",
    "TrainNode",
    "ValueNode",
]
