"""The machine a result was measured on, as the recipe records it (``pipeline.environment``) and states it with
every table (``results.md``, ``sweep.md``): the CPU model, its logical CPUs, the AVX flags that decide torch's CPU
kernel level, and the GPUs. The recipe's numbers reproduce per machine kind, not across kinds
(docs/arithmetic.md, "Reproducibility")."""

from __future__ import annotations

__all__ = ["VECTOR_FLAGS", "cpu_info", "gpu_names", "machine_line"]

VECTOR_FLAGS = ("avx512f", "avx2")  # the /proc/cpuinfo flags that decide torch's CPU kernel level


def cpu_info(cpuinfo: str) -> dict:
    """From the text of ``/proc/cpuinfo``: the first ``model name``, the number of ``processor`` entries (logical
    CPUs) and which of :data:`VECTOR_FLAGS` the first ``flags`` line has."""
    model, flags, processors = None, None, 0
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            processors += 1
        elif key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and flags is None:
            flags = set(value.split())
    return {"cpu": model, "logical_cpus": processors or None,
            "cpu_flags": [flag for flag in VECTOR_FLAGS if flag in (flags or ())]}


def gpu_names() -> list[str]:
    """The GPUs ``nvidia-smi`` lists (none without it); asks the driver, so this process never opens CUDA."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()] if listed.returncode == 0 else []


def machine_line(env: dict) -> str:
    """The machine kind of an ``environment()`` record, one line for a table's caption: CPU model, logical
    CPUs (those available), AVX flags, torch's kernel level and threads, GPUs, versions. An entry the record
    lacks (an older one) reads "unknown"."""
    def get(key: str):
        value = env.get(key)
        return "unknown" if value is None else value

    flags, gpus, packages = env.get("cpu_flags"), env.get("gpus"), env.get("packages") or {}
    flag_text = "unknown" if flags is None else " ".join(flags) if flags else "none of " + "/".join(VECTOR_FLAGS)
    gpu_text = "unknown" if gpus is None else ", ".join(gpus) if gpus else "none"
    return (f"{get('cpu')} ({get('machine')}), {get('logical_cpus')} logical CPUs ({get('cpus_available')} "
            f"available), flags {flag_text}, torch kernels {get('torch_cpu_capability')}, {get('torch_threads')} "
            f"torch threads; GPUs: {gpu_text}; python {get('python')}, torch {packages.get('torch', 'unknown')}, "
            f"verl {packages.get('verl', 'unknown')}")
