"""The verl tests that stop short of passing on daskwg, and why: :data:`STOPS_AT`.

Read by ``verl_suite_plugin`` (in the suite's child process) and by ``tests/test_verl_suite.py``
(in the main test process): importing it installs no stand-in.
"""

from __future__ import annotations

#: verl tests that run on daskwg up to one step that cannot pass here: test id ->
#: (what that step's error says, why). The test must get that far and fail exactly there;
#: it is reported as xfailed with the reason, and as failed if it fails anywhere else or passes.
STOPS_AT = {
    "tests/single_controller/test_worker_group_basics.py::test_basics": (
        "Torch not compiled with CUDA enabled",
        "needs a GPU: its last step, execute_func_rank_zero(add_one, ...), moves a tensor to verl's "
        "get_device_name(), which is 'cuda' on a machine without accelerators (verl falls back to its "
        "nvidia platform); every step before it ran on daskwg",
    ),
    "tests/test_protocol_on_cpu.py::test_chunk_concat": (
        "DID NOT RAISE",
        "documented deviation (docs/porting.md): daskwg's DataProto.chunk(5) of 6 rows returns exactly 5 "
        "pieces where verl asserts",
    ),
}
