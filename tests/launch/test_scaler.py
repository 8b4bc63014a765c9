"""The fp16 loss scale survives a checkpoint: DeepSpeed's own DynamicLossScaler, a real
safetensors round trip of the state file's tensors (fp16 itself does not run on the CPU)."""

from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from safetensors.torch import load_file, save_file

from launch.scaler import restore_scaler, scaler_fields
from shard_tools.state import RunState


def scaler() -> DynamicLossScaler:
    return DynamicLossScaler(init_scale=2.0**16, scale_window=10, min_scale=1.0, delayed_shift=2,
                             consecutive_hysteresis=False)


def test_loss_scale_carries_through_a_file(tmp_path):
    before = scaler()
    # Where a run with overflows got to (update_scale itself needs a process group).
    before.cur_scale, before.cur_iter, before.last_overflow_iter, before.cur_hysteresis = 1024.0, 37, 30, 1
    save_file(RunState(data_position=0, scaler=scaler_fields(before)).tensors(step=0), str(tmp_path / "state.safetensors"))
    after = scaler()
    assert restore_scaler(after, RunState.of(load_file(str(tmp_path / "state.safetensors"))).scaler)
    for key in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"):
        assert getattr(after, key) == getattr(before, key), key
    assert isinstance(after.cur_iter, int) and after.cur_scale == 1024.0


def test_nothing_to_restore_without_a_scaler_or_saved_state():
    assert scaler_fields(None) == {}
    assert not restore_scaler(None, {"cur_scale": 2.0})
    assert not restore_scaler(scaler(), {})
