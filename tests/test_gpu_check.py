"""`scripts/gpu_check.sh` as far as a CPU goes: its dry run, the commands it builds, how it reads both throughputs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from flywheel.inference.server import vllm_cli
from scripts.gpu_check import (
    CONCURRENCY,
    bench_command,
    bench_requests_per_second,
    process_command,
    requests_per_second,
)

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_lists_the_steps_and_same_concurrency_commands() -> None:
    result = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["steps"][-1] == "round_cuda" and plan["round"][-2:] == ["--device", "cuda"]
    bench = plan["bench"]
    assert bench[:5] == [*vllm_cli(), "bench", "serve"] and bench[bench.index("--max-concurrency") + 1] == str(
        CONCURRENCY
    )
    assert bench[bench.index("--tokenizer") + 1] == "<smollm2 dir>"  # The served name is no tokenizer vLLM can load.
    process = plan["process"]
    groups_in_flight = int(process[process.index("--env.process_concurrency") + 1])
    assert groups_in_flight * int(process[process.index("--env.group_size") + 1]) == CONCURRENCY


def test_both_throughputs_are_read_as_requests_per_second(tmp_path: Path) -> None:
    assert bench_requests_per_second("Successful requests: 256\nRequest throughput (req/s):  41.73\n") == 41.73
    with pytest.raises(RuntimeError, match="no request throughput"):
        bench_requests_per_second("Traceback: CUDA out of memory")
    groups = tmp_path / "tuc.jsonl"
    turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"},
            {"role": "assistant", "content": "b"}]  # fmt: skip
    groups.write_text(json.dumps({"messages": [turn, turn[:2]]}) + "\n" + json.dumps({"messages": [turn]}) + "\n")
    groups.with_suffix(".stats.json").write_text(json.dumps({"seconds": 2.5}))
    assert requests_per_second(groups) == pytest.approx(5 / 2.5)
    bench = bench_command("http://h:8000/v1", "m", "tok")
    assert bench[bench.index("--base-url") + 1] == "http://h:8000"
    assert process_command("http://h:8000/v1", "m", "tok", groups)[1] == "environments/tool_use_chain.py"
