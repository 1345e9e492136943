"""Tile shapes, warps and pipeline depth for each kernel.

Under TRITON_INTERPRET=1 (CI, CPU) one small fixed configuration runs: interpreting is slow
and the tile shape does not change the function computed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int

    def launch_args(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages)


INTERPRETED = Config(32, 32, 1, 1)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def forward_config(problem) -> Config:
    if interpreting():
        return INTERPRETED
    wide = max(problem.head_dim, problem.head_dim_v)
    if wide <= 64:
        return Config(128, 128, 4, 3)
    if wide <= 128:
        return Config(128, 64, 4, 2) if problem.dtype != "float32" else Config(64, 32, 4, 2)
    return Config(64, 32, 4, 2)


def backward_configs(problem) -> tuple[Config, Config]:
    """(dK/dV config, dQ config): the dK/dV kernel holds a key tile of block_n rows."""
    if interpreting():
        return INTERPRETED, INTERPRETED
    wide = max(problem.head_dim, problem.head_dim_v)
    if wide <= 128 and problem.dtype != "float32":
        return Config(64, 128, 8, 3), Config(128, 64, 8, 3)
    return Config(32, 64, 4, 2), Config(64, 32, 4, 2)
