"""verl on the CPU for tests: one gloo rank and a CPU device platform, in a child process of the test.

verl 0.9.1 ships cuda/npu/rocm platforms only and picks `nvidia` when it finds no accelerator; its FSDP engines
register for cuda and npu. `start_cpu_rank` makes this process rank 0 of 1 over gloo with `cpu_platform` as verl's
device, before anything imports verl's workers (they read the device name at import).
"""

from __future__ import annotations

import os

import torch
from torch.distributed.elastic.utils.distributed import get_free_port

#: FSDP2 in float32 for both verl models, as verl keys set directly: FSDP1 in bf16, the configured default, refuses
#: to run without an accelerator
CPU_SETTINGS = [f"+verl_backend.verl_config.{path}={value}"
                for role, engine in (("actor_rollout_ref.actor", "fsdp_config"), ("critic", "fsdp"))
                for path, value in ((f"{role}.strategy", "fsdp2"), (f"{role}.{engine}.strategy", "fsdp2"),
                                    (f"{role}.{engine}.mixed_precision",
                                     "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"))]


def cpu_platform():
    """verl's device abstraction on the CPU (verl picks `nvidia` when it finds no accelerator)."""
    from contextlib import contextmanager

    from verl.plugin.platform.platform_base import PlatformBase

    class CpuDeviceModule:
        """torch.cpu, with the CUDA memory queries verl logs answered with zeros."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return getattr(torch.cpu, name) if hasattr(torch.cpu, name) else (lambda *args, **kwargs: 0)

        def mem_get_info(self, *args):
            return 0, 1

        def get_device_name(self, *args):
            return "CPU"

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = CpuDeviceModule()

        def is_available(self): return True
        def current_device(self): return torch.device("cpu")
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, device_index=0): return None, None
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        @contextmanager
        def nvtx_range(self, msg): yield
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

    return PlatformCPU()


def start_cpu_rank() -> None:
    """This process as rank 0 of a one-rank gloo group, verl's platform the CPU one (call before importing
    verl.workers); VERL_ENGINE_DEVICE picks the engine registered for cuda (the FSDP engines register cuda and npu)."""
    from verl.plugin.platform.platform_manager import set_platform

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      VERL_ENGINE_DEVICE="cuda")
    set_platform(cpu_platform())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
