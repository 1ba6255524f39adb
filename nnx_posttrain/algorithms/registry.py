"""Every algorithm, by name, in one table (``ALGORITHMS``), in the order the command line and
the method table list them: SFT, the preference methods, the online ones, distillation.

Nothing registers itself: importing an algorithm's module defines its class and nothing more;
this table names the built-in ones. ``python -m experiments ALGORITHM``, ``nnx_posttrain.api``,
``nnx_posttrain.runs`` and the method table read it.
"""

from __future__ import annotations

from nnx_posttrain.algorithms.distill import Distill
from nnx_posttrain.algorithms.kto import KTO
from nnx_posttrain.algorithms.online.grpo import GRPO
from nnx_posttrain.algorithms.online.online_dpo import OnlineDPO
from nnx_posttrain.algorithms.online.ppo import PPO
from nnx_posttrain.algorithms.online.rloo import RLOO
from nnx_posttrain.algorithms.preference import CPO, DPO, ORPO, SimPO
from nnx_posttrain.algorithms.reward import Reward
from nnx_posttrain.algorithms.sft import SFT

ALGORITHMS: dict[str, type] = {cls.name: cls for cls in (
    SFT, DPO, SimPO, CPO, ORPO, KTO, Reward, GRPO, RLOO, PPO, OnlineDPO, Distill)}


def get(name: str) -> type:
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; registered: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def names() -> list[str]:
    return list(ALGORITHMS)


def summary(cls: type) -> str:
    """The first line of an algorithm's settings docstring: its one-line description."""
    return ((cls.Config.__doc__ or cls.__doc__ or "").strip().splitlines() or [""])[0]
