"""Every benchmark script runs its --smoke version and writes a table."""

import importlib
import json
import pathlib
import subprocess
import sys

import pytest
from absl import flags

from tests.helpers import run_forked

ROOT = pathlib.Path(__file__).resolve().parents[1]


# A flag that shapes the table must show on the page: it carried --smoke only, so a table
# made with --ns showed the command of another table. The output folder stays off the page.
EXTRA_FLAGS = {"compile_scale": ["--ns=8,16"]}


# The command lines of the tests below that check what a script refuses (or that two import
# together): {name: (script, args)}, each run by ``smoke_runs`` with an --out_dir of its own
# where it takes one.
REFUSALS = {
    "import_together": ("-c", ["import experiments.bench.micro_batches as a, "
                               "experiments.bench.sharded_memory as b; assert a.SIZES is b.SIZES"]),
    "sizes_micro_batches": ("experiments.bench.micro_batches", ["--sizes=tiny", "--out_dir"]),
    "sizes_sharded_memory": ("experiments.bench.sharded_memory", ["--sizes=tiny", "--out_dir"]),
    "negative_peak": ("experiments.bench.gpu", ["--smoke", "--peak_tflops=-989", "--out_dir"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory):
    """{script: (its --out_dir, [exit status, stderr, stdout])} of every selected case of
    test_benchmark_smoke, each ``python -m experiments.bench.<script> --smoke`` run in a child
    forked from one process that imported JAX once (``helpers.run_forked``): each script's
    imports only, not an interpreter's with JAX's, per case. Then the same of every case of
    REFUSALS, by its name."""
    scripts = [item.callspec.params["script"] for item in request.session.items
               if item.originalname == "test_benchmark_smoke"]  # fmt: skip
    dirs = {s: tmp_path_factory.mktemp(f"bench_{s}") for s in [*scripts, *REFUSALS]}
    cases = [(f"experiments.bench.{s}", ["--smoke", *EXTRA_FLAGS.get(s, []), "--out_dir",
                                         str(dirs[s])]) for s in scripts]  # fmt: skip
    cases += [(script, [*args, str(dirs[name])] if args[-1] == "--out_dir" else args)
              for name, (script, args) in REFUSALS.items()]  # fmt: skip
    return dict(zip([*scripts, *REFUSALS],
                    zip(dirs.values(), run_forked(cases, ROOT, timeout=1800))))


@pytest.mark.parametrize("script", [
    pytest.param("overhead", marks=pytest.mark.slow), "comm_volume",
    pytest.param("scaling", marks=pytest.mark.slow), "throughput", "clip_traffic",
    "compile_scale", "diloco_exchange", pytest.param("sharded_memory", marks=pytest.mark.slow),
    "micro_batches",
    pytest.param("opt_level", marks=pytest.mark.slow),
    pytest.param("gpu_attention", marks=pytest.mark.slow),
    pytest.param("routing_compile", marks=pytest.mark.slow),
    pytest.param("suite_time", marks=pytest.mark.slow),
])  # overhead and scaling time ~25 s of repetitions each; sharded_memory compiles 6 programs;
#     opt_level trains twice in fresh processes (~45 s); suite_time runs pytest on a test file
def test_benchmark_smoke(script, smoke_runs):
    extra = EXTRA_FLAGS.get(script, [])
    tmp_path, (code, stderr, _) = smoke_runs[script]
    assert code == 0, stderr[-3000:]
    results = json.loads((tmp_path / f"bench_{script}.json").read_text())
    md = (tmp_path / f"bench_{script}.md").read_text()
    command = " ".join([f"python -m experiments.bench.{script} --smoke", *extra])
    assert results["env"]["jax"] and f"`{command}`" in md, md[:500]  # exactly these flags
    assert str(tmp_path) not in md and "out_dir" not in md
    assert results["env"]["commit"]  # the checkout's short hash ("unknown" without .git)
    assert md.count("|") > 10


@pytest.mark.slow
def test_gpu_benchmark_dry_run_on_cpu(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "experiments.bench.gpu", "--smoke", "--out_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "bench_gpu_dryrun.json").read_text())
    assert {r["method"] for r in results["rows"]} == {"plain", "dp", "diloco", "noloco"}
    assert all(r["tokens_per_s"] > 0 for r in results["rows"])
    assert "not a GPU" in (tmp_path / "bench_gpu_dryrun.md").read_text()


def _import_alone(name: str):
    """A script imported for its helpers; the absl flags it defined are removed again.

    Two scripts may define one flag name (gpu and gpu_attention both have --reps), so a test
    that imports one in this process must not leave its flags behind for the next. The flags
    every script shares (``experiments.options``) stay.
    """
    importlib.import_module("experiments.options")
    before = set(flags.FLAGS)
    module = importlib.import_module(name)
    added = set(flags.FLAGS) - before
    for flag in added:
        delattr(flags.FLAGS, flag)
    if added:
        del sys.modules[name]  # a later import defines them again
    return module


def test_throughput_case_flag_parses_and_refuses_bad_shapes():
    from absl import app

    throughput = _import_alone("experiments.bench.throughput")

    assert throughput.parse_case("small,8,1024,10,7") == ("small", 8, 1024, 10, 7)
    for bad, says in [("small,8,1024", "expected preset,batch"), ("tiny,8,0,10,7", "positive"),
                      ("tiny,8,x,10,7", "positive"), ("huge,1,1,1,1", "preset must be one of")]:
        with pytest.raises(app.UsageError, match=says) as err:
            throughput.parse_case(bad)
        assert err.value.exitcode == 2


def test_gpu_attention_counts_cudnn_fused_attention_calls():
    gpu_attention = _import_alone("experiments.bench.gpu_attention")
    hlo = ('%a = custom-call(%q), custom_call_target="__cudnn$fmhaSoftmax"\n'
           '%b = custom-call(%d), custom_call_target="__cudnn$fmhaSoftmaxBackward"\n'
           '%c = custom-call(%x), custom_call_target="__cublas$lt$matmul"\n')
    assert gpu_attention.cudnn_attention_calls(hlo) == 2
    assert gpu_attention.cudnn_attention_calls(hlo.replace("cudnn$fmha", "other")) == 0


def test_suite_time_counts_programs_that_differ_only_in_their_constants(tmp_path):
    suite_time = _import_alone("experiments.bench.suite_time")
    body = ("module @jit_{name} {{\n  func.func public @main(%arg0: tensor<4x64xf32>) -> "
            "tensor<4x64xf32> {{\n    %c = stablehlo.constant dense<{c}> : tensor<f32> "
            "loc(#loc3)\n    return %arg0 : tensor<4x64xf32>\n  }}\n}}\n"
            "#loc3 = loc(\"x.py\":{c})\n")
    programs = [("step", "3.0e-03"), ("step", "3.0e-03"), ("other", "3.0e-03"), ("step", "0.1")]
    (tmp_path / "gw0").mkdir()
    for i, (name, c) in enumerate(programs):  # as JAX names its dumps
        (tmp_path / "gw0" / f"jax_ir{i:04d}_jit_{name}_compile.mlir").write_text(
            body.format(name=name, c=c))
    (tmp_path / "gw0" / "jax_ir0004_jit_step_compile.mlir").write_text(
        body.format(name="step", c="1").replace("4x64", "4x32"))  # another shape
    assert suite_time.distinct_programs(tmp_path) == {"gw0": {
        "programs": 5, "distinct": 3,  # the repeat and the renamed copy are the first
        "distinct_but_constants": 2,  # 0.1 for 3e-3: one shape; 4x32 stays apart
        "compiled_again": {"step": 1, "other": 1}}}


def test_environment_records_the_commit_and_takes_it_from_the_environment(monkeypatch):
    from experiments.bench import common

    monkeypatch.setenv("NOLOCO_JAX_COMMIT", "abc1234")
    assert common.environment()["commit"] == "abc1234"
    monkeypatch.delenv("NOLOCO_JAX_COMMIT")
    assert common.environment()["commit"] == common.git_commit()


def test_gpu_flops_per_token_count_the_output_head_when_tied():
    """A tied head was left out: 6 V D FLOPs per token (10 % of nano's) were missing."""
    from noloco_jax import models

    gpu = _import_alone("experiments.bench.gpu")
    untied = models.get_preset("nano", vocab_size=256)
    tied = models.get_preset("nano", vocab_size=256, tie_embeddings=True)
    body = models.param_count(untied, non_embedding=True)
    want = 6.0 * (body + 256 * 64) + 12.0 * 2 * 32 * 64  # blocks + head, attention at T = 32
    assert gpu.model_flops_per_token(untied, 32) == want
    assert gpu.model_flops_per_token(tied, 32) == want


def test_gpu_peak_flops_tell_pcie_and_nvl_cards_from_sxm():
    """"H100" matched first, so a PCIe or NVL card got the SXM peak: its MFU 16-24 % low."""
    gpu = _import_alone("experiments.bench.gpu")
    want = {"NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756, "NVIDIA H100 NVL": 835,
            "NVIDIA H200": 989, "NVIDIA H200 NVL": 835, "NVIDIA A100-SXM4-80GB": 312}
    assert {k: gpu.peak_flops(k, 0.0) for k in want} == {k: v * 1e12 for k, v in want.items()}
    assert gpu.peak_flops("cpu", 0.0) is None and gpu.peak_flops("cpu", 100.0) == 100e12


def test_the_memory_benchmarks_share_their_flags_and_import_together(smoke_runs):
    """Each defined --sizes and --usable: importing both in one process died with absl's
    DuplicateFlagError, and the two definitions could drift apart."""
    _, (code, stderr, _) = smoke_runs["import_together"]  # python -c, in a forked child
    assert code == 0, stderr[-2000:]


@pytest.mark.parametrize("script", ["micro_batches", "sharded_memory"])
def test_memory_benchmarks_refuse_sizes_without_a_paper_batch(script, smoke_runs):
    """--sizes took any preset, then PAPER_BATCH[size] raised KeyError (after compiling)."""
    _, (code, stderr, _) = smoke_runs[f"sizes_{script}"]  # python -m, in a forked child
    assert code != 0 and "KeyError" not in stderr, stderr[-2000:]
    assert "--sizes" in stderr and "['small', 'medium', 'large', 'nano']" in stderr


def test_gpu_benchmark_refuses_a_negative_peak(smoke_runs):
    """--peak_tflops=-989 was taken, ignored, and the peak looked up from the device."""
    _, (code, stderr, _) = smoke_runs["negative_peak"]  # python -m, in a forked child
    assert code != 0 and "--peak_tflops" in stderr, stderr[-2000:]
