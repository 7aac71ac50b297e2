"""``radixkv bench cancel-release``: a fresh server (tiny model, SmolLM2's tokenizer) under a
small load with cancelled streams; the server's cancel count, timings and pool state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixkv.cli import BENCHES, load_bench, main
from tests.conftest import make_tiny_model_dir

cancel_release = load_bench("cancel-release")


def test_registered_as_a_bench() -> None:
    assert "cancel-release" in BENCHES


@pytest.mark.parametrize(("flag", "value"), [("--cancel-fraction", "1.5"),
                                             ("--cancel-fraction", "-0.1"),
                                             ("--concurrency", "0"), ("--max-tokens", "3"),
                                             ("--prefill-close-window-ms", "-1"),
                                             ("--kv-cache-memory", "0")])
def test_bad_flags_exit_2_naming_the_flag(flag: str, value: str,
                                          capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "cancel-release", flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


@pytest.mark.parametrize("arg", ["--serve-arg=--port=8450", "--serve-arg=--host"])
def test_serve_arg_cannot_move_the_server(arg: str, capsys: pytest.CaptureFixture) -> None:
    # The driver polls the free port it picked: a --port / --host for the server is refused.
    with pytest.raises(SystemExit) as exc:
        main(["bench", "cancel-release", arg])
    assert exc.value.code == 2
    assert "argument --serve-arg:" in (err := capsys.readouterr().err) and "chosen by the driver" in err


def test_plan_alternates_phases_and_is_seeded() -> None:
    plan = cancel_release.plan_cancels(50, 0.2, 64, seed=3, prefill_window_ms=100.0)
    assert len(plan) == 10
    phases = [plan[i][0] for i in sorted(plan)]
    assert phases == ["prefill", "decode"] * 5
    assert all(0 <= plan[i][1] <= 100 for i in plan if plan[i][0] == "prefill")
    assert all(1 <= plan[i][1] <= 32 for i in plan if plan[i][0] == "decode")
    assert plan == cancel_release.plan_cancels(50, 0.2, 64, seed=3, prefill_window_ms=100.0)
    assert cancel_release.plan_cancels(50, 0.0, 64, seed=3, prefill_window_ms=100.0) == {}


def test_bucket_ranks_and_prometheus_quantile() -> None:
    # 4 samples: 1 in (0, 1 ms], 2 in (1, 10 ms], 1 above 10 ms.
    buckets = [(0.001, 1), (0.01, 3), (float("inf"), 4)]
    assert cancel_release.bucket_of_rank(buckets, 0.5) == (1.0, 10.0)   # rank 2
    assert cancel_release.bucket_of_rank(buckets, 0.25) == (0.0, 1.0)   # rank 1
    assert cancel_release.bucket_of_rank(buckets, 0.99) == (10.0, float("inf"))
    assert cancel_release.histogram_quantile_ms(buckets, 0.5) == pytest.approx(5.5)
    assert cancel_release.histogram_quantile_ms(buckets, 0.99) == pytest.approx(10.0)
    assert cancel_release.bucket_of_rank([(0.001, 0), (float("inf"), 0)], 0.5) is None


def test_small_load_every_cancel_counted_and_the_pool_idle_after(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path / "tiny", max_position_embeddings=8192)
    out = tmp_path / "cancel.json"
    # A prefill close window of 0: close as soon as the request is admitted, so on this fast
    # model some closes can still come before the first token.
    code = main(["bench", "cancel-release", "--model", str(model), "--kv-cache-memory", "0.1",
                 "--requests", "10", "--concurrency", "2", "--cancel-fraction", "0.4",
                 "--seed", "1", "--prefill-close-window-ms", "0", "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == (0 if result["all_checks_ok"] else 1)
    assert result["requests"] == 10 and result["concurrency"] == 2
    assert result["cancels_sent"] == 4
    assert result["cancels_sent_prefill"] + result["cancels_sent_decode"] == 4
    assert result["cancels_counted"] == result["cancels_sent"]
    assert result["outcomes"]["abort"] == 4 and result["outcomes"]["length"] == 6
    checks = result["checks"]
    assert checks["cancels_counted"] and checks["all_requests_ended"] and checks["pool_idle"]
    assert checks["histogram_agrees"]
    pool = result["pool"]
    assert pool["live_blocks"] == pool["in_use_blocks"] == 0
    assert result["running_sequences"] == result["waiting_sequences"] == 0
    assert 0 < result["cancel_release_ms_p50"] <= result["cancel_release_ms_p99"]
    assert 0 < result["itl_ms_p50"] <= result["itl_ms_p99"]
    assert result["itl_streams"] == 6 and result["itl_samples"] >= 6 * 60
    assert 0 < result["step_ms_p50"] <= result["step_ms_p99"] <= result["step_ms_max"]
    assert result["bound_ms"] == pytest.approx(result["step_ms_max"] + 50.0)
    assert result["within_bound"] == (result["cancel_release_ms_p99"] <= result["bound_ms"])
    assert result["itl_bound_ms"] == pytest.approx(result["itl_ms_p99"] + 50.0)
    assert result["within_itl_bound"] == (result["cancel_release_ms_p99"] <= result["itl_bound_ms"])
    hist = result["histogram"]
    assert hist["buckets_s"][-1] == ["+Inf", 4]
    lo, hi = hist["p99_bucket_ms"]
    assert lo < result["cancel_release_ms_p99"] <= hi
    assert result["provenance"]["machine"]["cores"] >= 1
    # Every cancel paired with the server's request_aborted line (its X-Request-Id).
    phases = result["close_to_release_ms"]
    assert phases["prefill"]["cancels"] + phases["decode"]["cancels"] == 4
    assert phases["prefill"]["timed"] + phases["decode"]["timed"] == 4
    rows = [dict(zip(result["per_request_columns"], row)) for row in result["per_request"]]
    assert len(rows) == 10
    cancelled = [r for r in rows if r["cancel_phase"] is not None]
    assert len(cancelled) == 4 and all(r["close_to_release_ms"] > 0 for r in cancelled)
    assert all(r["chunks"] >= 32 and r["close_to_release_ms"] is None
               for r in rows if r["cancel_phase"] is None)
