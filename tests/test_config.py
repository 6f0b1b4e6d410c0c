"""The configuration is strict: every bad input is one line naming key, value and what is allowed.

Also: defaults round-trip through YAML, overrides are typed by the schema, and the
CLI turns a ConfigError into exit code 2 without a traceback (real subprocesses).
"""

import subprocess
import sys

import pytest
from procs import a3po

from a3po.config import Config, ConfigError, all_keys, dump_yaml, load_config
from a3po.config.load import default_of


def error_of(overrides=None, path=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_defaults_are_the_embedded_a3po_run():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.actor.use_decoupled_loss is True
    assert cfg.actor.prox_logp_method == "loglinear"
    assert cfg.rollout.max_head_offpolicyness > 0
    assert cfg.actor.path == "smollm2-135m-instruct"
    assert cfg.train_dataset.task == "chain_sum"


@pytest.mark.parametrize("name", ["tiny", "yardstick", "yardstick-retry", "equivalence"])
def test_every_preset_loads_and_names_its_run(name):
    from a3po.config.load import presets

    assert name in presets()
    cfg = load_config(preset=name)
    assert cfg.experiment_name == name
    if name != "tiny":  # the evidence studies' held-out sets: a standard error near 0.03
        assert cfg.evaluator.size >= 256
    if name == "yardstick-retry":
        assert cfg.train_dataset.env == "retry" and cfg.train_dataset.max_turns == 3


def test_every_key_has_help_and_a_default_that_passes_its_own_rules():
    for key, f in all_keys().items():
        assert f.metadata.get("help"), key
        value = default_of(f)
        if "choices" in f.metadata:
            assert value in f.metadata["choices"], key


def test_overrides_are_typed_by_the_schema():
    cfg = load_config(None, [
        "actor.optimizer.lr=3e-5", "experiment_name=007", "actor.eps_clip_higher=0.28",
        "actor.c_clip=null", "gconfig.stop=[a, b]", "actor.use_decoupled_loss=true",
        "train_dataset.task_params={min_terms: 3}",
    ])
    assert cfg.actor.optimizer.lr == pytest.approx(3e-5) and isinstance(cfg.actor.optimizer.lr, float)
    assert cfg.experiment_name == "007"
    assert cfg.actor.eps_clip_higher == pytest.approx(0.28)
    assert cfg.actor.c_clip is None
    assert cfg.gconfig.stop == ["a", "b"]
    assert cfg.train_dataset.task_params == {"min_terms": 3}


def test_yaml_file_then_overrides_win(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("actor:\n  optimizer:\n    lr: 1e-6\n  prox_logp_method: linear\ngconfig:\n  n_samples: 4\n")
    cfg = load_config(p, ["gconfig.n_samples=6"])
    assert cfg.actor.optimizer.lr == pytest.approx(1e-6)  # PyYAML's '1e-6' string accepted as a float
    assert cfg.actor.prox_logp_method == "linear"
    assert cfg.gconfig.n_samples == 6


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["actor.prox_logp_method=metrics", "rollout.max_head_offpolicyness=4"])
    p = tmp_path / "resolved.yaml"
    p.write_text(dump_yaml(cfg))
    assert load_config(p) == cfg


@pytest.mark.parametrize("override, needles", [
    ("actor.prox_logp_method=loglinar",
     ["actor.prox_logp_method", "'loglinar'", "recompute, loglinear", "did you mean 'loglinear'"]),
    ("actor.eps_clp=0.3", ["unknown key 'actor.eps_clp'", "did you mean 'actor.eps_clip'"]),
    ("prox_logp_method=recompute", ["did you mean 'actor.prox_logp_method'"]),
    ("actor.eps_clip=2", ["actor.eps_clip", "2.0", "< 1"]),
    ("gconfig.n_samples=0", ["gconfig.n_samples", ">= 1"]),
    ("gconfig.n_samples=four", ["gconfig.n_samples", "'four'", "integer"]),
    ("actor.use_decoupled_loss=maybe", ["actor.use_decoupled_loss", "true or false"]),
    ("gconfig.temperature=null", ["gconfig.temperature='null'", "not a number"]),
    ("actor=3", ["'actor' is a section", "actor.path="]),
    ("no_equals_sign", ["must look like key=value"]),
    ("actor.policy_loss=cipso", ["actor.policy_loss='cipso'", "ppo, cispo, sapo", "did you mean 'cispo'"]),
    ("actor.correction.mis=icepop", ["actor.correction.mis='icepop'", "none, token, sequence, geometric"]),
    ("actor.correction.tis_cap=1", ["actor.correction.tis_cap", "> 1"]),
])
def test_bad_override_names_key_value_and_what_is_allowed(override, needles):
    msg = error_of([override])
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("overrides, needles", [
    (["actor.prox_logp_method=reuse", "actor.ppo_n_minibatches=4"],
     ["actor.ppo_n_minibatches=4", "reuse", "ppo_n_minibatches=1"]),
    (["actor.use_decoupled_loss=false", "actor.prox_logp_method=recompute"],
     ["actor.prox_logp_method", "use_decoupled_loss=true"]),
    (["actor.use_decoupled_loss=false", "actor.behav_imp_weight_cap=3"],
     ["actor.behav_imp_weight_cap", "use_decoupled_loss=true"]),
    (["actor.loss_agg_norm=24"], ["actor.loss_agg_norm", "seq-mean-token-sum"]),
    (["actor.adv_norm.mean_leave1out=true", "actor.adv_norm.mean_level=batch"], ["mean_leave1out", "mean_level=group"]),
    (["train_dataset.task=file"], ["train_dataset.path", "task=file"]),
    (["gconfig.n_samples=1"], ["gconfig.n_samples", "mean_level=batch", "std_level=batch"]),
    (["actor.correction.mis=geometric"], ["actor.correction.mis='geometric'", "mis_low", "0.99 and 1.01"]),
    (["actor.correction.mis=token", "actor.correction.mis_low=2", "actor.correction.mis_high=0.5"],
     ["actor.correction.mis_low=2", "must be below actor.correction.mis_high=0.5"]),
    (["actor.use_decoupled_loss=false", "actor.correction.tis=token"],
     ["actor.correction.tis='token'", "coupled PPO", "actor.correction.ratio=current"]),
    # what the line above tells users to set, half done: the group of one has no std to divide by
    (["gconfig.n_samples=1", "actor.adv_norm.mean_level=batch"],
     ["actor.adv_norm.std_level='group'", "std_level=batch or none"]),
])
def test_inconsistent_combinations_are_refused(overrides, needles):
    msg = error_of(overrides)
    for needle in needles:
        assert needle in msg, (needle, msg)


JUDGE = ["reward_service.kind=judge", "reward_service.url=http://127.0.0.1:1"]
SCORER = ["reward_service.kind=scorer", "reward_service.url=http://127.0.0.1:1"]


@pytest.mark.parametrize("overrides, key, reader", [
    (["train_dataset.path=sums.jsonl"], "train_dataset.path='sums.jsonl'", "train_dataset.task=file"),
    (["train_dataset.question_key=problem"], "train_dataset.question_key", "train_dataset.task=file"),
    (["train_dataset.answer_key=solution"], "train_dataset.answer_key", "train_dataset.task=file"),
    (["train_dataset.task=file", "train_dataset.path=x.jsonl", "train_dataset.task_params={min_terms: 3}"],
     "train_dataset.task_params", "a procedural train_dataset.task"),
    (["train_dataset.max_turns=3"], "train_dataset.max_turns=3", "train_dataset.env or train_dataset.agent"),
    (["train_dataset.max_context_tokens=512"], "train_dataset.max_context_tokens", "train_dataset.env"),
    (["train_dataset.turn_discount=0.5"], "train_dataset.turn_discount", "train_dataset.env"),
    (["train_dataset.env_timeout_s=9"], "train_dataset.env_timeout_s", "train_dataset.env"),
    (["train_dataset.agent=a:run", "train_dataset.env_timeout_s=9"], "train_dataset.env_timeout_s",
     "train_dataset.env"),
    (["train_dataset.agent_timeout_s=9"], "train_dataset.agent_timeout_s", "train_dataset.agent"),
    (["train_dataset.env=retry", "train_dataset.agent_timeout_s=9"], "train_dataset.agent_timeout_s",
     "train_dataset.agent"),
    (["train_dataset.tool_call_format=llama3"], "train_dataset.tool_call_format", "train_dataset.agent"),
    (["actor.kl_estimator=k1"], "actor.kl_estimator", "actor.kl_ctl"),
    (["actor.sapo_tau_neg=2"], "actor.sapo_tau_neg", "actor.policy_loss=sapo"),
    (["actor.policy_loss=cispo", "actor.c_clip=5"], "actor.c_clip", "actor.policy_loss=ppo"),
    (["actor.policy_loss=sapo", "actor.eps_clip_higher=0.28"], "actor.eps_clip_higher",
     "actor.policy_loss=ppo or cispo"),
    (["actor.correction.tis_cap=3"], "actor.correction.tis_cap", "actor.correction.tis=token or sequence"),
    (["actor.correction.mis_high=3"], "actor.correction.mis_high", "actor.correction.mis=token"),
    (["actor.correction.ratio=current"], "actor.correction.ratio", "actor.correction.tis or mis"),
    (["actor.behav_imp_weight_cap=null", "actor.behav_imp_weight_mode=token_truncate"], "actor.behav_imp_weight_mode",
     "actor.behav_imp_weight_cap"),
    (["actor.adv_norm.std_level=none", "actor.adv_norm.eps=0.1"], "actor.adv_norm.eps", "actor.adv_norm.std_level"),
    (["rollout.vllm_gpu_memory=0.3"], "rollout.vllm_gpu_memory", "rollout.backend=vllm"),
    (["rollout.vllm_compile=false"], "rollout.vllm_compile", "rollout.backend=vllm"),
    ([*SCORER, "reward_service.max_tokens=8"], "reward_service.max_tokens", "reward_service.kind=judge"),
    ([*SCORER, "reward_service.template=hi"], "reward_service.template", "reward_service.kind=judge"),
    ([*JUDGE, "reward_service.batch_size=2"], "reward_service.batch_size", "reward_service.kind=scorer"),
    (["logging.wandb_project=mine"], "logging.wandb_project", "logging.wandb=true"),
    (["cluster.ray_placement=SPREAD"], "cluster.ray_placement", "cluster.launcher=ray"),
])
def test_a_key_the_chosen_settings_never_read_is_refused_naming_both(overrides, key, reader):
    msg = error_of(overrides)
    assert msg.startswith(key) and f"only read with {reader}" in msg and "drop" in msg, msg


@pytest.mark.parametrize("overrides", [
    ["train_dataset.question_key=question", "train_dataset.answer_key=answer"],  # the defaults: not set
    ["train_dataset.task=file", "train_dataset.path=x.jsonl", "train_dataset.question_key=problem",
     "train_dataset.system_prompt=Be brief."],
    ["train_dataset.env=retry", "train_dataset.max_turns=3", "train_dataset.turn_discount=0.5"],
    ["train_dataset.agent=a:run", "train_dataset.max_turns=3", "train_dataset.agent_timeout_s=9",
     "train_dataset.tool_call_format=mistral"],
    ["actor.kl_ctl=0.1", "actor.kl_estimator=k1"],
    ["actor.policy_loss=sapo", "actor.sapo_tau_pos=0.5"],
    ["actor.correction.ratio=current", "actor.correction.mis=geometric", "actor.correction.mis_low=0.99",
     "actor.correction.mis_high=1.01", "actor.correction.opsm_delta=0.1"],
    ["actor.use_decoupled_loss=false", "actor.correction.ratio=current", "actor.correction.tis=sequence",
     "actor.correction.tis_cap=3"],
    ["rollout.backend=vllm", "rollout.vllm_gpu_memory=0.3", "rollout.vllm_compile=false"],
    [*JUDGE, "reward_service.max_tokens=8"],
    [*SCORER, "reward_service.batch_size=2"],
])
def test_a_key_its_setting_reads_is_accepted_and_round_trips(overrides, tmp_path):
    cfg = load_config(None, overrides)
    p = tmp_path / "resolved.yaml"
    p.write_text(dump_yaml(cfg))
    assert load_config(p) == cfg


def test_the_tiny_preset_loads_with_a_file_of_ones_own(tmp_path):
    """tiny sets train_dataset.size, which a file task does not read: `--preset tiny` with a file must still load,
    and its saved configuration load again (--resume)."""
    cfg = load_config(None, ["train_dataset.task=file", "train_dataset.path=x.jsonl"], preset="tiny")
    p = tmp_path / "resolved.yaml"
    p.write_text(dump_yaml(cfg))
    assert load_config(p) == cfg and cfg.train_dataset.task == "file"


def test_coupled_loss_alone_is_fine_even_though_the_default_method_is_decoupled():
    cfg = load_config(None, ["actor.use_decoupled_loss=false"])
    assert cfg.actor.use_decoupled_loss is False


@pytest.mark.parametrize("std_level", ["batch", "none"])
def test_one_sample_per_prompt_with_batch_baseline_is_accepted(std_level):
    overrides = ["gconfig.n_samples=1", "actor.adv_norm.mean_level=batch", f"actor.adv_norm.std_level={std_level}"]
    cfg = load_config(None, overrides)
    assert cfg.gconfig.n_samples == 1


def test_reuse_with_one_minibatch_is_accepted():
    assert load_config(None, ["actor.prox_logp_method=reuse"]).actor.prox_logp_method == "reuse"


def test_yaml_errors(tmp_path):
    assert "does not exist" in error_of(path=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  eps_clip: [0.2\n")
    assert "not valid YAML" in error_of(path=bad) and "line" in error_of(path=bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    assert "mapping" in error_of(path=scalar)
    typo = tmp_path / "typo.yaml"
    typo.write_text("actor:\n  optimiser:\n    lr: 1.0e-5\n")
    assert "did you mean 'actor.optimizer" in error_of(path=typo)
    wrong_type = tmp_path / "type.yaml"
    wrong_type.write_text("actor:\n  ppo_n_minibatches: 2.5\n")
    assert "actor.ppo_n_minibatches=2.5" in error_of(path=wrong_type)
    bool_as_int = tmp_path / "bool.yaml"
    bool_as_int.write_text("gconfig:\n  n_samples: true\n")
    assert "expected int" in error_of(path=bool_as_int)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"seed: 1\nexperiment_name: caf\xe9\n")
    assert "not UTF-8 text (byte 0xe9 on line 2)" in error_of(path=latin1)
    assert "is a directory" in error_of(path=tmp_path)


def test_cli_bad_override_exits_2_with_one_line():
    res = a3po("train", "actor.prox_logp_method=loglinar")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert lines[0].startswith("a3po: config error: actor.prox_logp_method='loglinar'")


def test_cli_missing_config_file_exits_2(tmp_path):
    res = a3po("train", "--config", str(tmp_path / "nope.yaml"))
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr


def test_cli_help_lists_every_key():
    res = a3po("train", "--help")
    assert res.returncode == 0
    for key in all_keys():
        assert f"  {key} (" in res.stdout, key


def test_cli_config_prints_loadable_yaml(tmp_path):
    res = a3po("config", "actor.prox_logp_method=linear")
    assert res.returncode == 0
    p = tmp_path / "out.yaml"
    p.write_text(res.stdout)
    assert load_config(p).actor.prox_logp_method == "linear"


def test_variant_names_come_from_one_list_each_read_without_torch():
    from a3po.algo import variants
    from a3po.algo.schedule import LR_SCHEDULES
    from a3po.bench.args import METHODS
    from a3po.config import choices

    keys = all_keys()
    lists = {
        "actor.prox_logp_method": variants.PROX_METHODS,
        "actor.behav_imp_weight_mode": variants.BEHAV_WEIGHT_MODES,
        "actor.importance_sampling_level": variants.IS_LEVELS,
        "actor.loss_agg_mode": variants.AGG_MODES,
        "actor.kl_estimator": variants.KL_ESTIMATORS,
        "actor.adv_norm.mean_level": variants.ADV_NORM_LEVELS,
        "actor.adv_norm.std_level": variants.ADV_NORM_LEVELS,
        "actor.optimizer.lr_scheduler_type": tuple(LR_SCHEDULES),
    }
    for key, names in lists.items():
        assert tuple(keys[key].metadata["choices"]) == names, key
    assert set(METHODS) == set(variants.PROX_METHODS) - {"metrics"}
    settings = {  # the enumerated settings code branches on: one vocabulary each (config/choices.py)
        "actor.dtype": choices.Dtype.CHOICES, "rollout.dtype": choices.Dtype.CHOICES,
        "rollout.backend": choices.Backend.CHOICES, "rollout.forward": choices.Forward.CHOICES,
        "rollout.weight_update": choices.WeightUpdate.CHOICES, "cluster.launcher": choices.Launcher.CHOICES,
        "cluster.data_parallel": choices.DpMode.CHOICES,
        "train_dataset.tool_call_format": choices.ToolCallFormat.CHOICES,
    }
    for key, names in settings.items():
        assert tuple(keys[key].metadata["choices"]) == names and default_of(keys[key]) in names, key
    # the CLI (--help included) builds every choice list without paying torch's import
    code = "import sys, a3po.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120, check=False).returncode == 0

