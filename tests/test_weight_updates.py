"""Issue 48 defect 9: SGLang's runtime weight updates rewrite expert tensors in place, which VAMP's offloaded
experts (served from host copies through staging slots) would never see. With VAMP on, each scheduler-side
handler answers with SGLang's own failure output and touches nothing; with the ratio 0 it runs as in SGLang.
The hooks are called here as SGLang's HookRegistry calls an "around" hook, over SGLang's real
`SchedulerWeightUpdaterManager` methods and io_struct types, without a server."""

from types import SimpleNamespace

import pytest
from sglang.srt.managers import io_struct
from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager

from vamp_sglang.integration import plugin, runtime

HANDLERS = ["update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed",
            "update_weights_from_ipc", "begin_weight_update"]
_TARGET = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager."


def _hook(handler):
    hooks = [h for h in plugin.all_hooks() if h.target == _TARGET + handler]
    assert len(hooks) == 1, f"no VAMP hook on SchedulerWeightUpdaterManager.{handler}"
    assert hooks[0].kind == "around"
    return hooks[0]


def _manager():
    """SGLang's manager with one target runner whose weight writes are recorded (no TP group needed)."""
    written = []
    def write(path, load_format, **kwargs):
        written.append(path)
        return True, "ok"

    updater = SimpleNamespace(update_weights_from_disk=write)
    runner = SimpleNamespace(weight_updater=updater)
    manager = object.__new__(SchedulerWeightUpdaterManager)
    fields = {"tp_worker": SimpleNamespace(weight_update_runners=lambda: [("target", runner)]),
              "draft_worker": None, "metrics_collector": None, "_session": None,
              "scheduler": SimpleNamespace(record_weight_version_change=lambda new_version: None),
              "flush_cache": lambda empty_cache=False: True}
    for name, value in fields.items():
        object.__setattr__(manager, name, value)
    return manager, written


def _vamp(monkeypatch, ratio):
    config = SimpleNamespace(enabled=ratio > 0, max_offload_ratio=ratio)
    monkeypatch.setattr(runtime, "_current", SimpleNamespace(config=config))


@pytest.mark.parametrize("handler", HANDLERS)
def test_with_vamp_on_every_in_place_weight_update_is_refused_with_sglangs_own_output(monkeypatch, handler):
    _vamp(monkeypatch, 0.25)
    called = []
    out = _hook(handler).fn(lambda *args, **kwargs: called.append(args), object(), SimpleNamespace())
    assert not called
    assert out.success is False and handler in out.message and "vamp" in out.message
    output_type = type(out).__name__
    assert output_type.endswith("ReqOutput") and type(out) is getattr(io_struct, output_type)
    # the output the HTTP route reads: the matching SGLang type for the handler's input
    assert output_type.replace("Output", "Input") in {n for n in dir(io_struct) if n.endswith("ReqInput")}


def test_a_refused_disk_update_writes_no_weight_and_vamp_off_runs_sglangs_handler(monkeypatch):
    original = SchedulerWeightUpdaterManager.update_weights_from_disk
    hook = _hook("update_weights_from_disk")
    manager, written = _manager()
    request = UpdateWeightFromDiskReqInput(model_path="/models/new")
    _vamp(monkeypatch, 0.25)
    refused = hook.fn(original, manager, request)
    assert type(refused) is io_struct.UpdateWeightFromDiskReqOutput and not refused.success and written == []
    _vamp(monkeypatch, 0.0)  # stock SGLang through our launcher: the update runs
    done = hook.fn(original, manager, request)
    assert done.success and written == ["/models/new"]
    monkeypatch.setattr(runtime, "_current", None)  # a process with no VAMP runtime: untouched too
    assert hook.fn(original, manager, request).success and written == ["/models/new"] * 2
