"""csrc/cuda/tests' device-side helpers, made testable here: one of its Python tools (such as
attention_kernel_times.py) loaded as a module, one function of device_run.sh run alone, and the Nsight Compute CSV
that the tools read (its header and rows)."""

import importlib.util
import os
import subprocess

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cuda", "tests")
DEVICE_RUN = os.path.join(TOOLS, "device_run.sh")

# The columns of `ncu --csv` with one metric per kernel launch.
NCU_CSV_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
                  '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def ncu_csv_row(index, kernel, unit, value) -> str:
    """One launch's row of that CSV: its gpu__time_duration.sum, `value` in `unit`."""
    return (f'"{index}","1","python3","host","{kernel}","1","7","(256,1,1)","(132,1,1)","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}"')


def load_tool(file_name: str):
    spec = importlib.util.spec_from_file_location(os.path.splitext(file_name)[0], os.path.join(TOOLS, file_name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_device_run_function(repo, name, before="", check=True, env=None):
    """Runs device_run.sh's function `name` (with any arguments after it) alone, its text cut out of the script, in
    `repo`, after `before`."""
    function = name.split()[0]
    script = f"{before}\nsource <(sed -n '/^{function}() {{/,/^}}/p' {DEVICE_RUN}) && {name}"
    return subprocess.run(["bash", "-c", script], cwd=repo, check=check, capture_output=True, text=True, timeout=60,
                          env=env)
