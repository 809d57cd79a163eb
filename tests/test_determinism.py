"""config.deterministic: XLA's deterministic GPU ops, requested before JAX starts its backend."""

import os

import pytest

from noloco_jax import determinism, train
from noloco_jax.errors import UserError
from noloco_jax.experiments import harness
from tests.test_cli import nano_argv, run_cli

FLAG = determinism.FLAG
DEVICES = "--xla_force_host_platform_device_count=8"


@pytest.mark.parametrize("given, expected", [
    ("", f"{FLAG}=true"),
    (DEVICES, f"{DEVICES} {FLAG}=true"),
    (f"{DEVICES} {FLAG}", f"{DEVICES} {FLAG}"),  # a bare bool flag is true
    (f"{FLAG}=1 {DEVICES}", f"{FLAG}=1 {DEVICES}"),
    (f"{FLAG}=false {FLAG}=true", f"{FLAG}=false {FLAG}=true"),  # the last one wins
    (f"{FLAG}_extra=1", f"{FLAG}_extra=1 {FLAG}=true"),  # another flag, not this one
    (f'{FLAG}="true"', f'{FLAG}="true"'),  # XLA takes quoted values
    (f"{FLAG}='1'", f"{FLAG}='1'"),
])  # fmt: skip
def test_deterministic_adds_the_flag_once(given, expected):
    assert determinism.xla_flags(True, given) == expected


@pytest.mark.parametrize("given", ["", DEVICES, f"{FLAG}=false", f"{FLAG}=true"])
def test_not_deterministic_leaves_xla_flags_as_given(given):
    assert determinism.xla_flags(False, given) == given


@pytest.mark.parametrize("given, pattern", [
    (f"{DEVICES} {FLAG}=false", r"config\.deterministic=True but XLA_FLAGS sets .*=false: drop"),
    (f"{FLAG}=yes", r"XLA_FLAGS sets --xla_gpu_deterministic_ops='yes'; use true or false"),
    (f'{FLAG}="false"', r"config\.deterministic=True but XLA_FLAGS sets .*=false: drop"),
])  # fmt: skip
def test_a_contradicting_or_bad_xla_flag_is_refused(given, pattern):
    with pytest.raises(UserError, match=pattern):
        determinism.xla_flags(True, given)


@pytest.mark.parametrize("call", [lambda: determinism.xla_flags("no", ""),
                                  lambda: determinism.unmet("no", "gpu", ""),
                                  lambda: determinism.request(0)])  # fmt: skip
def test_deterministic_must_be_a_bool(call):
    """A str "no" and 0 were read as truthy/falsy: "no" added the flag and warned on a GPU."""
    with pytest.raises(UserError, match=r"^deterministic: must be True or False"):
        call()


@pytest.mark.parametrize("deterministic, platform, given, warned", [
    (True, "gpu", DEVICES, True),
    (True, "gpu", f"{FLAG}=false", True),
    (True, "gpu", f"{FLAG}=true", False),
    (True, "cpu", "", False),  # CPUs and TPUs are deterministic without it
    (True, "tpu", "", False),
    (False, "gpu", "", False),
])  # fmt: skip
def test_unmet_only_on_a_gpu_without_the_flag(deterministic, platform, given, warned):
    why = determinism.unmet(deterministic, platform, given)
    assert (why is not None) == warned
    if warned:
        assert "config.deterministic=True" in why and f"XLA_FLAGS='{FLAG}=true'" in why


def test_the_cli_requests_it_before_jax_starts_a_backend(tmp_path, corpus_dir, data_dir,
                                                         capsys, monkeypatch):  # fmt: skip
    # --num_processes without a coordinator stops right after the request, before any
    # training; the CLI's request is what puts the flag into this process's XLA_FLAGS.
    stop = ["--num_processes=2", "--process_id=0"]
    monkeypatch.setattr(determinism, "_backend_started", lambda: False)  # as in a fresh process
    monkeypatch.setenv("XLA_FLAGS", DEVICES)
    code, _ = run_cli(nano_argv(tmp_path / "a", corpus_dir, data_dir, *stop), capsys)
    assert code == train.USAGE_ERROR_EXIT and os.environ["XLA_FLAGS"] == f"{DEVICES} {FLAG}=true"
    monkeypatch.setenv("XLA_FLAGS", DEVICES)
    off = ["--config.deterministic=False", *stop]
    code, _ = run_cli(nano_argv(tmp_path / "b", corpus_dir, data_dir, *off), capsys)
    assert code == train.USAGE_ERROR_EXIT and os.environ["XLA_FLAGS"] == DEVICES
    monkeypatch.setenv("XLA_FLAGS", f"{DEVICES} {FLAG}=false")
    code, err = run_cli(nano_argv(tmp_path / "c", corpus_dir, data_dir), capsys)
    assert code == train.USAGE_ERROR_EXIT and "config.deterministic=True but XLA_FLAGS" in err
    assert not (tmp_path / "c").exists()  # refused before anything was made


def test_the_harness_requests_it_in_each_run(monkeypatch):
    # A worker process of experiments' grids starts JAX inside ``_train``: the request must
    # come first there, from the run's own config.
    from configs import common  # noqa: PLC0415
    from noloco_jax.trainer import loop  # noqa: PLC0415

    seen = []
    monkeypatch.setattr(determinism, "_backend_started", lambda: False)  # as in a fresh worker
    monkeypatch.setattr(loop, "train_and_evaluate",
                        lambda *a, **k: seen.append(os.environ["XLA_FLAGS"]))  # fmt: skip
    monkeypatch.setenv("XLA_FLAGS", DEVICES)
    harness._train(common.get_config(), "unused")
    assert seen == [f"{DEVICES} {FLAG}=true"]


def test_a_request_after_the_backend_started_leaves_xla_flags_so_the_trainer_warns(monkeypatch):
    # XLA read XLA_FLAGS when the backend started: adding the flag now would change nothing
    # but would silence the warning (a --config file that called jax.device_count(), say).
    import jax  # noqa: PLC0415

    jax.devices()
    monkeypatch.setenv("XLA_FLAGS", DEVICES)
    determinism.request(True)
    assert os.environ["XLA_FLAGS"] == DEVICES
    monkeypatch.setattr(determinism, "_platform", lambda: "gpu")
    assert "started its GPU backend without" in determinism.warning(True)
    monkeypatch.setenv("XLA_FLAGS", f"{DEVICES} {FLAG}=false")
    with pytest.raises(UserError, match="config.deterministic=True but XLA_FLAGS"):
        determinism.request(True)  # a contradiction is still refused


def test_xla_flags_naming_a_file_of_flags(tmp_path):
    # XLA reads an XLA_FLAGS that does not start with '-' as a file of flags; appending to
    # the name made XLA abort ("Could not open file ... to read flags").
    path = tmp_path / "xla.flags"
    path.write_text(f"{DEVICES}\n")
    assert determinism.xla_flags(True, str(path)) == f"{DEVICES}\n {FLAG}=true"
    assert determinism.xla_flags(False, str(path)) == str(path)
    path.write_text(f"{FLAG}=false\n")
    with pytest.raises(UserError, match="config.deterministic=True but XLA_FLAGS"):
        determinism.xla_flags(True, str(path))
    assert determinism.unmet(True, "gpu", str(path)) is not None
    path.write_text(f"{FLAG}=true\n")
    assert determinism.unmet(True, "gpu", str(path)) is None
    assert determinism.xla_flags(True, str(path)) == str(path)
    with pytest.raises(UserError, match="XLA reads it as the name of a file of flags"):
        determinism.xla_flags(True, str(tmp_path / "missing"))
