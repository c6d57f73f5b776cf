"""yafsdp.trainer.check_launch: what accelerate's launchers leave in the environment ([Note:
accelerate's launchers] in yafsdp/integrations/trainer.py), with no process started."""
from __future__ import annotations

import pytest

from yafsdp.trainer import TrainerSetupError, check_launch

SIMPLE_2 = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # MULTI_CPU, 2 asked


def test_one_process_of_several_refused():
    with pytest.raises(TrainerSetupError, match="world size 1.*MULTI_GPU"):
        check_launch(1, SIMPLE_2)


@pytest.mark.parametrize("world, env", [
    (2, {**SIMPLE_2, "RANK": "0", "WORLD_SIZE": "2"}),  # the processes exist (torchrun / a script's own start)
    (1, {**SIMPLE_2, "OMPI_COMM_WORLD_SIZE": "2"}),     # mpirun: the MPI world names them
    (1, {"ACCELERATE_USE_CPU": "True"}),                # `accelerate launch --cpu` of one process
    (1, {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}),  # torchrun --nproc-per-node 1
])
def test_other_launches_pass(world, env):
    assert check_launch(world, env) is None


@pytest.mark.parametrize("key, name", [("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED")])
def test_engine_configs_named(key, name):
    # on a CPU machine accelerate's state reports MULTI_CPU for these; the environment still says it
    assert check_launch(2, {key: "true", "RANK": "0", "WORLD_SIZE": "2"}) == name
    assert check_launch(2, {key: "false"}) is None
