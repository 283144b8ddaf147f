"""The configuration: presets load, overrides apply, and every kind of mistake gets a clear error."""
import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import yaml

from hymo.config import Config, ConfigError, ModelConfig, TrainingConfig, load_config, presets


def test_presets_shipped():
    assert {"hymo_tiny", "hymo_750m"} <= set(presets())


def test_750m_is_the_design():
    m = load_config("hymo_750m").model
    assert (m.dim, m.n_layers, m.vocab_size) == (896, 32, 64256)
    assert m.layer_types.count("gdn") == 24 and m.layer_types.count("mla") == 8
    assert [i for i, t in enumerate(m.layer_types) if t == "mla"] == [3, 7, 11, 15, 19, 23, 27, 31]
    assert (m.gdn_n_heads, m.gdn_head_k_dim, m.gdn_head_v_dim, m.ffn_inter_dim) == (40, 32, 32, 2560)
    assert (m.mla_n_heads, m.mla_n_kv_groups, m.mla_kv_lora_rank, m.mla_qk_nope_dim, m.mla_qk_rope_dim,
            m.mla_v_head_dim) == (16, 4, 128, 96, 32, 128)
    assert (m.moe_n_routed, m.moe_n_shared, m.moe_top_k, m.moe_inter_dim, m.moe_capacity_factor) == (16, 1, 2, 2304, 1.5)
    assert (m.mtp_depth, m.mtp_loss_weights) == (2, (0.3, 0.1))
    t = load_config("hymo_750m").train
    assert (t.seq_len, t.micro_batch_size) == (4096, 4)
    assert 29e9 < t.max_steps * t.global_batch_size * t.seq_len < 31e9


def test_the_dataclass_defaults_are_exactly_the_750m_preset():
    "A YAML file without `base:` is documented (and announced by a note) to start from hymo_750m's values: all of them."
    preset, design = load_config("hymo_750m"), Config()
    for sec in ("model", "train"):
        differ = {f.name: (getattr(getattr(design, sec), f.name), getattr(getattr(preset, sec), f.name))
                  for f in dataclasses.fields(getattr(design, sec)) if getattr(getattr(design, sec), f.name) != getattr(getattr(preset, sec), f.name)}
        assert not differ, f"{sec}: dataclass default vs hymo_750m: {differ}"
    assert load_config("hymo_tiny").train.compile is False  # the laptop preset stays eager


def test_field_names_are_unique_across_sections():
    m = {f.name for f in dataclasses.fields(ModelConfig)}
    t = {f.name for f in dataclasses.fields(TrainingConfig)}
    assert not m & t, "a bare override key must name exactly one field"


def test_every_field_has_a_docment():
    from fastcore.docments import docments
    for cls in (ModelConfig, TrainingConfig):
        docs = docments(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a one-line comment: {missing}"


def test_overrides_bare_and_dotted():
    c = load_config("hymo_tiny", dim=64, warmup_steps=1, **{"train.max_steps": 3, "model.n_layers": 8})
    assert (c.model.dim, c.train.max_steps, c.model.n_layers) == (64, 3, 8)
    assert c.model.layer_types == ["gdn", "gdn", "gdn", "mla"] * 2


def test_int_accepted_for_float_and_list_for_tuple():
    c = load_config("hymo_tiny", rope_theta=500000, mtp_loss_weights=[0.5, 0.25])
    assert isinstance(c.model.rope_theta, float) and c.model.mtp_loss_weights == (0.5, 0.25)


def test_numpy_numbers_are_taken_as_plain_ones():
    "A launcher's sweep often hands over numpy scalars: they are the numbers they hold, and the config still prints as YAML."
    np = pytest.importorskip("numpy")
    c = load_config("hymo_tiny", dim=np.int64(64), muon_lr=np.float32(0.02), adamw_lr=np.float64(1e-3),
                    mtp_loss_weights=[np.float64(0.3), 0], compile=np.True_, n_layers=np.uint8(4))
    assert (type(c.model.dim), type(c.train.muon_lr), type(c.train.adamw_lr), type(c.train.compile)) == (int, float, float, bool)
    assert c.model.dim == 64 and c.train.muon_lr == 0.02 and c.model.mtp_loss_weights == (0.3, 0.0) and c.model.n_layers == 4
    assert "dim: 64" in str(c) and "muon_lr: 0.02\n" in str(c) and "compile: true" in str(c)
    with pytest.raises(ConfigError, match="expected int, got float"): load_config("hymo_tiny", dim=np.float64(64.5))
    with pytest.raises(ConfigError, match="expected int, got bool"): load_config("hymo_tiny", dim=True)
    with pytest.raises(ConfigError, match="expected float, got bool"): load_config("hymo_tiny", muon_lr=False)
    with pytest.raises(ConfigError, match="expected bool, got int"): load_config("hymo_tiny", compile=np.int64(1))


def test_a_section_given_as_a_key_says_how_to_set_its_keys():
    with pytest.raises(ConfigError, match=r"'model' is a section, not a key: set its keys one by one, as model.vocab_size=\.\.\."):
        load_config("hymo_tiny", model={"dim": 64})
    from hymo.train import parse_overrides
    with pytest.raises(ConfigError, match=r"'train' is a section, not a key: set its keys one by one, as train\.(\w+)=") as e:
        load_config("hymo_tiny", **parse_overrides(["train=5"]))
    key = e.value.args[0].split("as train.")[1].split("=")[0]
    assert load_config("hymo_tiny", **{f"train.{key}": getattr(load_config("hymo_tiny").train, key)})  # the example is a real key


def test_unknown_key_names_the_closest():
    with pytest.raises(ConfigError, match=r"unknown key 'mla_n_head'\. Did you mean 'mla_n_heads'\?") as e:
        load_config("hymo_tiny", mla_n_head=4)
    assert "Valid keys:" in str(e.value) and "seq_len" in str(e.value)
    with pytest.raises(ConfigError, match=r"'train.lr'\. Did you mean 'muon_lr' or 'adamw_lr'.*\? Valid train keys"):
        load_config("hymo_tiny", **{"train.lr": 1.0})  # no close spelling: the keys it is a word of
    with pytest.raises(ConfigError, match=r"unknown key 'lr'\. Did you mean 'muon_lr' or 'adamw_lr'"):
        load_config("hymo_tiny", lr=1.0)
    with pytest.raises(ConfigError, match="unknown section"):
        load_config("hymo_tiny", **{"optim.lr": 1.0})


def test_wrong_type_names_the_expected_one():
    with pytest.raises(ConfigError, match=r"model.dim: expected int, got str 'big'"):
        load_config("hymo_tiny", dim="big")
    with pytest.raises(ConfigError, match=r"train.wandb: expected bool"):
        load_config("hymo_tiny", wandb="yes")
    with pytest.raises(ConfigError, match=r"expected int, got bool"):
        load_config("hymo_tiny", n_layers=True)


@pytest.mark.parametrize("overrides, words", [
    (dict(mla_n_heads=6, mla_n_kv_groups=4), ["mla_n_heads=6", "mla_n_kv_groups=4", "query heads"]),
    (dict(mla_qk_rope_dim=15), ["mla_qk_rope_dim=15", "pairs"]),
    (dict(global_batch_size=10, micro_batch_size=4), ["global_batch_size=10", "micro_batch_size=4"]),
    (dict(moe_top_k=9), ["moe_top_k=9", "moe_n_routed"]),
    (dict(mtp_depth=1), ["mtp_loss_weights", "mtp_depth=1"]),
    (dict(dim=0), ["model.dim=0", "positive"]),
    (dict(nope_layers=[0]), ["nope_layers [0]", "not MLA blocks"]),
    (dict(decay_shape="exp"), ["decay_shape", "'1-sqrt'"]),
])
def test_semantic_errors_say_which_and_why(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config("hymo_tiny", **overrides)
    for w in words: assert w in str(e.value)


def test_missing_preset_lists_the_presets(tmp_path):
    with pytest.raises(ConfigError, match="hymo_tiny"):
        load_config("hymo_huge")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  dim: 64\noptim:\n  lr: 1\n")
    with pytest.raises(ConfigError, match="has the sections .model:. and .train:"):
        load_config(str(bad))


def test_yaml_round_trip(tmp_path):
    c = load_config("hymo_750m", dim=1024)
    p = tmp_path / "run.yaml"
    d = c.to_dict(); d.pop("name")
    p.write_text(yaml.safe_dump(d))
    assert load_config(str(p)).model == c.model and load_config(str(p)).train == c.train


def test_print_from_the_command_line():
    out = subprocess.run([sys.executable, "-c", "from hymo.config import load_config; print(load_config('hymo_750m'))"],
                         capture_output=True, text=True, check=True).stdout
    assert "dim: 896" in out and "mla_n_kv_groups: 4" in out and "max_steps: 57220" in out


def test_warmup_must_end_before_the_decay():
    with pytest.raises(ConfigError, match=r"warmup_steps=12 runs into the decay, which starts at step 7"):
        load_config("hymo_tiny", max_steps=10)
    assert load_config("hymo_tiny", max_steps=10, warmup_steps=7).train.warmup_steps == 7


def test_triton_kernels_refuse_another_chunk_length():
    with pytest.raises(ConfigError, match=r"gdn_chunk_size=32 but the Triton GDN kernels run chunks of 64 only"):
        load_config("hymo_tiny", gdn_kernel="triton", gdn_chunk_size=32)
    assert load_config("hymo_tiny", gdn_kernel="torch", gdn_chunk_size=32).model.gdn_chunk_size == 32
    from hymo.config import check_triton_chunk
    from hymo.models.gdn import GatedDeltaNet  # 'auto' is resolved per call: the mixer refuses the Triton rule itself
    mixer = GatedDeltaNet(load_config("hymo_tiny", gdn_chunk_size=32).model)
    with pytest.raises(ConfigError, match=r"kernels \(which gdn_kernel: auto picks on a GPU\) run chunks of 64 only: .*gdn_kernel: torch"):
        mixer._rule("triton")  # refused before the kernels are imported (they would read TRITON_INTERPRET then)
    check_triton_chunk(64)


@pytest.mark.parametrize("over, expect", [
    (dict(eval_batches=0), r"train.eval_batches=0 must be positive"),
    (dict(log_every=-3), r"train.log_every=-3 must be positive"),
    (dict(warmup_steps=-1), r"train.warmup_steps=-1 must be 0 or more"),
    (dict(eval_every=-1), r"train.eval_every=-1 must be 0 or more"),
    (dict(ckpt_every=-5), r"train.ckpt_every=-5 must be 0 or more"),
    (dict(grad_clip=-1.0), r"train.grad_clip=-1.0 must be 0 or more"),
    (dict(muon_lr=-1.0), r"train.muon_lr=-1.0 must be positive"),
    (dict(min_lr_ratio=2.0), r"train.min_lr_ratio=2.0 must be in \[0, 1\]"),
    (dict(adamw_betas=(0.9, 1.5)), r"train.adamw_betas\[1\]=1.5 must be in \[0, 1\)"),
])
def test_training_values_that_would_be_silently_wrong_are_refused(over, expect):
    with pytest.raises(ConfigError, match=expect):
        load_config("hymo_tiny", **over)


@pytest.mark.parametrize("text, words", [
    ("train: 5\n", ["'train:' section must be a mapping", "found int 5"]),
    ("model: [1, 2]\n", ["'model:' section must be a mapping", "found list [1, 2]"]),
    ("[1, 2]\n", ["has the sections", "a list, not a mapping"]),
    ("{1: 2, a: 3}\n", ["has the sections", "['1', 'a']"]),  # keys of mixed types used to crash the sort
])
def test_yaml_file_whose_sections_are_not_mappings(tmp_path, text, words):
    p = tmp_path / "f.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    assert str(p) in str(e.value)
    for w in words: assert w in str(e.value)


def test_cli_turns_a_bad_section_into_one_error_line(tmp_path, capsys):
    from hymo.train import main
    p = tmp_path / "f.yaml"
    p.write_text("train: 5\n")
    with pytest.raises(SystemExit) as e:
        main(["--config", str(p)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m hymo.train: error:") and "must be a mapping" in err


def test_invalid_yaml_points_at_a_valid_example(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("model: {dim: [\n")
    with pytest.raises(ConfigError, match="is not valid YAML") as e:
        load_config(str(p))
    example = str(e.value).split("see ", 1)[1].split(" or ")[0]
    assert load_config(example).name == "hymo_tiny"  # the file it names exists and loads


def test_none_for_a_text_setting_says_how_to_write_off():
    with pytest.raises(ConfigError, match=r"got NoneType None; choose one of 'ema', 'sign', 'none' \(off is the word none\)$"):
        load_config("hymo_tiny", moe_balance=None)
    assert load_config("hymo_tiny", moe_balance="none").model.moe_balance == "none"


def test_an_empty_config_file_is_refused_not_read_as_the_750m_defaults(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("# to fill in\n")
    with pytest.raises(ConfigError, match="mine.yaml is empty: a config file has 'model:' and 'train:' sections"):
        load_config(str(p))


def _float_fields(cls):
    from hymo.config import _field_types
    return [n for n, tp in _field_types(cls).items() if tp in (float, Optional[float])]  # list items: the next test


@pytest.mark.parametrize("sec, name", [("model", n) for n in _float_fields(ModelConfig)] +
                                      [("train", n) for n in _float_fields(TrainingConfig)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_every_float_must_be_finite(sec, name, bad):
    with pytest.raises(ConfigError, match=rf"{sec}\.{name}={bad} must be a finite number"):
        load_config("hymo_tiny", **{f"{sec}.{name}": bad})


def test_list_items_must_be_finite():
    with pytest.raises(ConfigError, match=r"model\.mtp_loss_weights\[1\]=nan must be a finite number"):
        load_config("hymo_tiny", mtp_loss_weights=[0.3, float("nan")])
    with pytest.raises(ConfigError, match=r"train\.adamw_betas\[0\]=nan must be a finite number"):
        load_config("hymo_tiny", adamw_betas=[float("nan"), 0.95])


@pytest.mark.parametrize("over, expect", [
    (dict(init_std=-0.02), r"model.init_std=-0.02 must be positive"),
    (dict(norm_eps=0), r"model.norm_eps=0.0 must be positive"),
    (dict(rope_theta=-1), r"model.rope_theta=-1.0 must be positive"),
    (dict(mtp_loss_weights=[0.3, -0.1]), r"model.mtp_loss_weights=\[0.3, -0.1\] must be 0 or more: a negative weight trains against"),
    (dict(moe_ema_decay=1.0), r"model.moe_ema_decay=1.0 must be in \[0, 1\).*moe_balance: none"),
    (dict(moe_ema_decay=-0.5), r"model.moe_ema_decay=-0.5 must be in \[0, 1\)"),
    (dict(moe_bias_speed=-0.001), r"model.moe_bias_speed=-0.001 must be 0 or more"),
    (dict(moe_dead_band=-0.05), r"model.moe_dead_band=-0.05 must be 0 or more"),
    (dict(moe_dead_band=1.0), r"model.moe_dead_band=1.0 must be below 1: .*never raised"),
    (dict(n_layers=3), r"model.n_layers=3 with mla_every=4 has no MLA block .*n_layers ≥ 4.*mla_every=0 asks for GDN blocks only"),
    (dict(mla_every=-1), r"model.mla_every=-1 must be 0 or more"),
    (dict(mla_qk_rope_dim=15), r"model.mla_qk_rope_dim=15 must be even"),
    (dict(mla_n_kv_groups=3), r"model.mla_n_heads=4 is not divisible by model.mla_n_kv_groups=3"),
    (dict(global_batch_size=10, micro_batch_size=4), r"train.global_batch_size=10 is not divisible by train.micro_batch_size=4"),
    (dict(moe_n_shared=-1), r"model.moe_n_shared=-1 must be 0 or more"),
    (dict(mla_q_lora_rank=-5), r"model.mla_q_lora_rank=-5 must be 0 or more"),  # (0 means no query compression)
    (dict(mtp_depth=-1, mtp_loss_weights=[]), r"model.mtp_depth=-1 must be 0 or more"),
    (dict(adamw_eps=0), r"train.adamw_eps=0.0 must be positive: .*NaN"),
    (dict(seed=-1), r"train.seed=-1 must be 0 or more"),
    (dict(seed=2**64), r"train.seed=18446744073709551616 must be below 2\*\*64"),
    (dict(moe_capacity_factor=0), r"model.moe_capacity_factor=0.0 must be positive, or null"),
    (dict(muon_momentum=1.0), r"train.muon_momentum=1.0 must be in \[0, 1\)"),
    (dict(adamw_betas=[0.9, 1.0]), r"train.adamw_betas\[1\]=1.0 must be in \[0, 1\)"),
    (dict(moe_score_func="sigmoid", moe_top_k=1), r"model.moe_score_func='sigmoid' with model.moe_top_k=1 gives the router no gradient"),
])
def test_model_and_training_values_out_of_range_are_refused(over, expect):
    with pytest.raises(ConfigError, match=expect):
        load_config("hymo_tiny", **over)


@pytest.mark.parametrize("name", ["vocab_size", "dim", "n_layers", "gdn_n_heads", "gdn_head_k_dim", "gdn_head_v_dim",
    "gdn_conv_size", "gdn_chunk_size", "ffn_inter_dim", "mla_n_heads", "mla_n_kv_groups", "mla_kv_lora_rank",
    "mla_qk_nope_dim", "mla_qk_rope_dim", "mla_v_head_dim", "moe_n_routed", "moe_top_k", "moe_inter_dim",
    "mtp_inter_dim", "max_seq_len", "norm_eps", "init_std", "rope_theta"])
def test_every_size_and_scale_must_be_positive(name):
    "0 or less would build a model that cannot work (an empty matrix, NaN from the first norm or RoPE table, no init)."
    with pytest.raises(ConfigError, match=rf"model.{name}=(0|0\.0) must be positive"):
        load_config("hymo_tiny", **{f"model.{name}": 0})


def test_configs_changed_in_code_are_checked_where_they_are_used(tmp_path):
    """dataclasses.replace skips load_config's checks: the model, the trainer and the optimisers run them again, so a config
    edited in code cannot train silently wrong (a micro-batch of 3 read 15 of 16 sequences a step; an unknown
    moe_balance turned balancing off; a kv latent of 0 trained, and its config.yaml could not be read back)."""
    import dataclasses
    from hymo.models.model import build_hymo
    from hymo.training.optim import build_optimizers, wsd_schedule
    from hymo.training.trainer import Trainer
    c = load_config("hymo_tiny")
    for over, msg in [(dict(moe_balance="off"), "model.moe_balance='off': choose one of"),
                      (dict(mla_kv_lora_rank=0), "model.mla_kv_lora_rank=0 must be positive"),
                      (dict(n_layers=3), "model.n_layers=3 with mla_every=4 has no MLA block"),
                      (dict(nope_layers=(0,)), r"model.nope_layers \[0\] are not MLA blocks")]:
        with pytest.raises(ConfigError, match=msg): build_hymo(dataclasses.replace(c.model, **over), device="meta")
    with pytest.raises(ConfigError, match="global_batch_size=16 is not divisible by train.micro_batch_size=3"):
        Trainer(c.model, dataclasses.replace(c.train, micro_batch_size=3), run_dir=tmp_path / "run", quiet=True)
    with pytest.raises(ConfigError, match="train.seq_len=300 is longer than model.max_seq_len=256"):
        Trainer(c.model, dataclasses.replace(c.train, seq_len=300), run_dir=tmp_path / "run", quiet=True)
    assert not (tmp_path / "run").exists()  # refused before anything is written
    with pytest.raises(ConfigError, match="train.weight_decay=5.0 with train.muon_lr=0.5"):
        build_optimizers(build_hymo(c.model), dataclasses.replace(c.train, muon_lr=0.5, weight_decay=5.0))
    normuon, _ = build_optimizers(build_hymo(c.model), dataclasses.replace(c.train, muon_lr="2e-2"))  # as text: the checked copy
    assert normuon.param_groups[0]["lr"] == 0.02
    for over in (dict(min_lr_ratio=2.0), dict(decay_fraction=-0.5)):
        with pytest.raises(ValueError, match=rf"{next(iter(over))}=.* must be in \[0, 1\]"): wsd_schedule(0, dataclasses.replace(c.train, **over))
    assert c.model.moe_capacity_factor == 1.5 and isinstance(c.train.muon_lr, float)  # the caller's configs are not changed
    m = build_hymo(dataclasses.replace(c.model, norm_eps="1e-6", moe_capacity_factor="none"), device="meta")
    assert m.config.norm_eps == 1e-6 and m.config.moe_capacity_factor is None  # the model keeps the normalised copy
    from pathlib import Path
    assert load_config("hymo_tiny", data_dir=Path("data/mine")).train.data_dir == "data/mine"  # a Path is a path


def test_a_bool_setting_says_how_to_write_it():
    for v in (1, "y", "maybe"):
        with pytest.raises(ConfigError, match="train.compile: expected bool, .*; write true or false"): load_config("hymo_tiny", compile=v)


def test_a_misspelt_section_of_a_config_file_is_named(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("base: hymo_tiny\nmodle:\n  dim: 64\ntrian:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match="found \\['base', 'modle', 'trian'\\]; did you mean 'model' for 'modle'\\?; did you mean 'train' for 'trian'\\?"):
        load_config(f)


def test_a_key_outside_its_section_of_a_config_file_is_placed(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("base: hymo_tiny\nmax_steps: 5\ndim: 64\n")
    with pytest.raises(ConfigError, match="found \\['base', 'dim', 'max_steps'\\]; put 'max_steps' under 'train:'; put 'dim' under 'model:'"):
        load_config(f)
    f.write_text("base: hymo_tiny\nmodel.n_layers: 4\n")  # the command line's spelling
    with pytest.raises(ConfigError, match="put 'model.n_layers' under 'model:' \\(as 'n_layers:'\\)"):
        load_config(f)


def test_zero_stays_allowed_where_it_means_off():
    c = load_config("hymo_tiny", grad_clip=0, weight_decay=0, moe_bias_speed=0, moe_dead_band=0, moe_ema_decay=0,
                    mtp_loss_weights=[0, 0], mla_q_lora_rank=0, moe_n_shared=0, sample_tokens=0, seed=0)
    assert (c.train.grad_clip, c.model.moe_ema_decay, c.model.mtp_loss_weights) == (0.0, 0.0, (0.0, 0.0))


def test_a_key_in_the_wrong_section_says_where_it_lives():
    with pytest.raises(ConfigError, match=r"'model.max_steps': max_steps is a train key; write max_steps=\.\.\. or train.max_steps="):
        load_config("hymo_tiny", **{"model.max_steps": 3})
    with pytest.raises(ConfigError, match=r"'train.dim': dim is a model key; write dim=\.\.\. or model.dim="):
        load_config("hymo_tiny", **{"train.dim": 64})


def test_type_errors_say_how_to_write_the_value():
    from hymo.train import parse_overrides
    with pytest.raises(ConfigError, match=r"train.run_dir: expected str, got int 2024; quote it \(run_dir: '...' in a YAML file\)"):
        load_config("hymo_tiny", run_dir=2024)
    assert load_config("hymo_tiny", **parse_overrides(["run_dir='2024'"])).train.run_dir == "2024"  # the hint works
    with pytest.raises(ConfigError, match=r"train.max_steps: expected int, got str '1e3'; write it as a whole number: 1000$"):
        load_config("hymo_tiny", **parse_overrides(["max_steps=1e3"]))
    with pytest.raises(ConfigError, match=r"model.dim: expected int, got float 64.0; write it as a whole number: 64$"):
        load_config("hymo_tiny", dim=64.0)
    with pytest.raises(ConfigError, match=r"model.dim: expected int, got float 64.5$"):  # no whole number to suggest
        load_config("hymo_tiny", dim=64.5)


def test_a_config_file_that_is_not_text_or_not_a_file_is_one_clear_error(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\x8b\x00\xff\xfe")
    with pytest.raises(ConfigError, match=r"bin.yaml is not a text file \(not UTF-8\)"): load_config(str(tmp_path / "bin.yaml"))
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"dir.yaml cannot be read"): load_config(str(tmp_path / "dir.yaml"))
    (tmp_path / "run").mkdir(); (tmp_path / "run" / "config.yaml").write_text("train:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"run is a folder but not a .yaml file.*run/config.yaml"): load_config(str(tmp_path / "run"))
    (tmp_path / "notes.txt").write_text("dim: 3\n")
    with pytest.raises(ConfigError, match=r"notes.txt is a file but not a .yaml file"): load_config(str(tmp_path / "notes.txt"))


def test_decay_steps_round_to_the_nearest_step():
    c = load_config("hymo_tiny", max_steps=100, decay_fraction=0.29, warmup_steps=1).train
    assert c.decay_steps == 29  # int() of 28.999999999999996 would give 28


def test_a_folder_named_like_a_preset_does_not_hide_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hymo_tiny").mkdir()  # e.g. run_dir=hymo_tiny
    assert load_config("hymo_tiny").name == "hymo_tiny"


def test_a_key_given_twice_in_a_yaml_file_is_refused(tmp_path):
    "Plain YAML keeps the last of two equal keys without a word: one `adamw_lr:` edited and another left below would be ignored."
    p = tmp_path / "twice.yaml"
    p.write_text("base: hymo_tiny\ntrain:\n  adamw_lr: 0.01\n  max_steps: 5\n  adamw_lr: 0.002\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: 'adamw_lr' is given twice \(lines 3 and 5\)"):
        load_config(str(p))
    p.write_text("base: hymo_tiny\nmodel:\n  dim: 64\ntrain:\n  max_steps: 5\nmodel:\n  n_heads: 2\n")  # a whole section twice
    with pytest.raises(ConfigError, match=r"'model' is given twice \(lines 2 and 6\)"):
        load_config(str(p))
    p.write_text("base: hymo_tiny\nmodel:\n  dim: 64\ntrain:\n  adamw_lr: 0.01\n")  # the same keys in two sections are fine
    assert load_config(str(p)).train.adamw_lr == 0.01
    # a flow mapping's key twice on one line too; `<<: *base` merges, overridden or nested, are not duplicates
    p.write_text("base: hymo_tiny\ntrain: {adamw_lr: 0.01, seed: 5, adamw_lr: 0.002}\n")
    with pytest.raises(ConfigError, match=r"'adamw_lr' is given twice \(line 2\)"):
        load_config(str(p))
    p.write_text("base: hymo_tiny\ntrain: &t {seed: 5, max_steps: 200}\nmodel:\n  dim: 64\n")
    assert load_config(str(p)).train.seed == 5
    from hymo.config import _UniqueKeys
    nested = "b: &B {x: 1}\na: &A {<<: *B, x: 2}\nc: {<<: *A, y: 3}\n"  # A merged into c after its own override of B's x
    got = yaml.load(nested, Loader=_UniqueKeys)
    assert got["a"] == {"x": 2} and got == yaml.load(nested, Loader=yaml.SafeLoader)  # c's x: 2 in PyYAML 6.0.3, 1 in 6.0.4


def test_a_key_set_twice_by_overrides_is_refused():
    "Two spellings of one key, or one key given twice on the command line, would keep one value without a word."
    from hymo.train import parse_overrides
    with pytest.raises(ConfigError, match=r"'dim' and 'model.dim' both set model.dim: give it once"):
        load_config("hymo_tiny", **{"dim": 64, "model.dim": 96})
    with pytest.raises(ConfigError, match=r"'max_steps' is given twice on the command line"):
        parse_overrides(["max_steps=10", "seed=1", "max_steps=20"])
    assert load_config("hymo_tiny", **parse_overrides(["dim=64", "train.seed=3"])).train.seed == 3


def test_out_of_range_schedule_and_decay_are_refused():
    with pytest.raises(ConfigError, match=r"decay_fraction=-0.5 must be in \[0, 1\]"):
        load_config("hymo_tiny", decay_fraction=-0.5)
    with pytest.raises(ConfigError, match=r"decay_fraction=1.5 must be in \[0, 1\]"):
        load_config("hymo_tiny", decay_fraction=1.5)
    with pytest.raises(ConfigError, match=r"seq_len=512 is longer than model.max_seq_len=256"):
        load_config("hymo_tiny", seq_len=512, max_seq_len=256)
    with pytest.raises(ConfigError, match=r"weight_decay=50.0 with train.muon_lr=.*flipping them; give weight_decay <"):
        load_config("hymo_tiny", weight_decay=50.0)
    cfg = load_config("hymo_tiny")
    lr = cfg.train.adamw_lr
    with pytest.raises(ConfigError, match=r"train.adamw_lr=.*zeroing them"):
        load_config("hymo_tiny", weight_decay=1 / lr, muon_lr=lr / 2)
    assert load_config("hymo_tiny", weight_decay=0.5).train.weight_decay == 0.5


def test_a_config_file_without_base_is_said_to_start_from_the_design_defaults(tmp_path):
    from hymo.train import design_defaults_note
    (tmp_path / "mine.yaml").write_text("train:\n  max_steps: 3\n")
    assert re.search(r"has no 'base:', so the \d+ values it does not set are the design defaults \(hymo_750m's: seq_len=4096",
                     design_defaults_note(str(tmp_path / "mine.yaml")))
    (tmp_path / "based.yaml").write_text("base: hymo_tiny\ntrain:\n  max_steps: 3\n")
    (tmp_path / "printed.yaml").write_text(str(load_config("hymo_tiny")))  # a run's config.yaml sets every value
    assert design_defaults_note(str(tmp_path / "based.yaml")) is None and design_defaults_note(str(tmp_path / "printed.yaml")) is None
    assert design_defaults_note("hymo_tiny") is None
    from hymo.config import PRESET_DIR
    assert design_defaults_note(str(PRESET_DIR / "hymo_tiny.yaml")) is None  # a preset's own file: nothing unset differs


def test_the_weight_decay_bound_it_names_holds_for_both_learning_rates():
    import math
    with pytest.raises(ConfigError, match=r"train.adamw_lr=0.1: .*give weight_decay < 10, or check adamw_lr") as e:
        load_config("hymo_tiny", muon_lr=0.06, adamw_lr=0.1, weight_decay=15.0)  # the larger rate sets the bound
    with pytest.raises(ConfigError) as e:
        load_config("hymo_tiny", muon_lr=0.06, adamw_lr=0.001, weight_decay=17.0)
    bound = float(str(e.value).split("give weight_decay < ")[1].split(",")[0])
    assert bound <= 1 / 0.06 and load_config("hymo_tiny", muon_lr=0.06, adamw_lr=0.001, weight_decay=bound).train.weight_decay == bound


def test_decay_fraction_that_rounds_to_zero_steps_still_decays_one_step():
    c = load_config("hymo_tiny", max_steps=4, warmup_steps=1, decay_fraction=0.1).train  # 0.4 rounds to 0
    assert c.decay_steps == 1
    assert load_config("hymo_tiny", max_steps=4, warmup_steps=1, decay_fraction=0.0).train.decay_steps == 0


@pytest.mark.parametrize("word", ["none", "None"])
def test_the_word_none_turns_an_optional_setting_off(word):
    c = load_config("hymo_tiny", moe_capacity_factor=word, data_dir=word)
    assert c.model.moe_capacity_factor is None and c.train.data_dir is None


def test_top_k_may_equal_the_number_of_routed_experts():
    assert load_config("hymo_tiny", moe_top_k=4).model.moe_top_k == 4  # hymo_tiny has 4 routed experts


def test_negative_nope_layer_index_is_refused():
    with pytest.raises(ConfigError, match=r"nope_layers \[-1\] are not MLA blocks"):
        load_config("hymo_tiny", nope_layers=[-1])  # is_mla(-1) is True: only the range check refuses it


def test_schedule_bounds_are_inclusive_where_documented():
    assert load_config("hymo_tiny", min_lr_ratio=1.0).train.min_lr_ratio == 1.0  # [0, 1]: a constant rate
    assert load_config("hymo_tiny", decay_fraction=1.0, warmup_steps=0).train.decay_steps == 120  # all decay
    with pytest.raises(ConfigError, match=r"train.min_lr_ratio=-0.1 must be in \[0, 1\]"):
        load_config("hymo_tiny", min_lr_ratio=-0.1)


def test_sequence_length_bounds():
    assert load_config("hymo_tiny", seq_len=256).train.seq_len == 256  # == max_seq_len is fine
    with pytest.raises(ConfigError, match=r"train.seq_len=2 leaves MTP head 2 no position"):
        load_config("hymo_tiny", seq_len=2)  # mtp_depth=2


def test_base_files_naming_each_other_are_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="in a circle"):
        load_config(str(tmp_path / "a.yaml"))


def test_other_field_checks():
    with pytest.raises(ConfigError, match=r"adamw_betas=\(0.9, 0.95, 0.99\): give two numbers"):
        load_config("hymo_tiny", adamw_betas=[0.9, 0.95, 0.99])
    with pytest.raises(ConfigError, match=r"model.max_seq_len=0 must be positive"):
        load_config("hymo_tiny", max_seq_len=0, seq_len=1, mtp_depth=0, mtp_loss_weights=[])
    with pytest.raises(ConfigError, match=r"model.gdn_conv_size=0 must be positive"):
        load_config("hymo_tiny", gdn_conv_size=0)
    with pytest.raises(ConfigError, match=r"train.run_dir=' ' is empty"):
        load_config("hymo_tiny", run_dir=" ")
    with pytest.raises(ConfigError, match=r"model.mtp_loss_weights=\[0.3, -0.5\] must be 0 or more"):
        load_config("hymo_tiny", mtp_loss_weights=[0.3, -0.5])
    with pytest.raises(ConfigError, match=r"model.gdn_kernel='cuda': choose one of"):
        load_config("hymo_tiny", gdn_kernel="cuda")
    with pytest.raises(ConfigError, match=r"train.precision='fp16': choose one of"):
        load_config("hymo_tiny", precision="fp16")


@pytest.mark.parametrize("overrides, message", [
    (dict(moe_top_k=5), "model.moe_top_k=5 > model.moe_n_routed=4"),  # one past the experts hymo_tiny has
    (dict(nope_layers=[4]), "model.nope_layers [4] are not MLA blocks"),  # one past its last block
    (dict(seq_len=257), "train.seq_len=257 is longer than model.max_seq_len=256"),
    *[({k: 0}, f"train.{k}=0 must be positive") for k in ("max_steps", "keep_last_k", "ns_steps", "max_bad_steps")],
    (dict(sample_tokens=-1), "train.sample_tokens=-1 must be 0 or more"),
    (dict(data_dir=" "), "train.data_dir=' ' is empty"),
    (dict(adamw_betas=[0.9]), "give two numbers, (beta1, beta2)"),
    (dict(mtp_loss_weights=0.3), "model.mtp_loss_weights: expected a list of float, got float 0.3"),
    (dict(gdn_kernel="triton", gdn_chunk_size=128), "gdn_chunk_size=128 but the Triton GDN kernels run chunks of 64 only"),
    *[({k: v}, f"{k}={v!r}: choose one of") for k, v in (("gdn_kernel", "cuda"), ("moe_score_func", "Softmax"),
                                                        ("moe_balance", "emma"), ("decay_shape", "exp"), ("precision", "fp16"))],
])
def test_each_check_refuses_the_first_value_past_its_limit(overrides, message):
    with pytest.raises(ConfigError) as e: load_config("hymo_tiny", **overrides)
    assert message in str(e.value)


def test_the_values_at_each_limit_are_accepted():
    "The other side of the boundaries above: the largest (or smallest) value each check lets through."
    c = load_config("hymo_tiny", moe_top_k=4, nope_layers=[3], seq_len=256, sample_tokens=0, adamw_betas=[0, 0],
                    muon_momentum=0.0, max_bad_steps=1)
    assert (c.model.moe_top_k, c.model.nope_layers, c.train.seq_len, c.train.adamw_betas) == (4, (3,), 256, (0.0, 0.0))


def test_a_yml_file_its_name_and_a_base_that_is_not_text(tmp_path):
    (tmp_path / "mine.yml").write_text("base: hymo_tiny\nname: my-run\ntrain:\n  max_steps: 70\n")
    c = load_config(str(tmp_path / "mine.yml"))
    assert (c.name, c.train.max_steps, c.model.dim) == ("my-run", 70, load_config().model.dim)
    assert load_config().name == "hymo_tiny"  # the default preset
    (tmp_path / "five.yaml").write_text("base: 5\n")
    with pytest.raises(ConfigError, match=r"five.yaml: 'base:' names one preset .* found 5"): load_config(str(tmp_path / "five.yaml"))


def test_text_keys_on_the_command_line_keep_the_text_as_typed():
    "YAML would read run_dir=007 as 7, 12:30 as 750, 0x10 as 16, a date as a date and off as False: a text key keeps what was typed."
    from hymo.train import parse_overrides
    c = load_config("hymo_tiny", **parse_overrides(["run_dir=007", "data_dir=2024-12-05", "wandb_project=0x10"]))
    assert (c.train.run_dir, c.train.data_dir, c.train.wandb_project) == ("007", "2024-12-05", "0x10")
    assert parse_overrides(["run_dir=12:30", "seed=0x10", "adamw_lr=1e-3"]) == {"run_dir": "12:30", "seed": 16, "adamw_lr": "1e-3"}
    assert load_config("hymo_tiny", **parse_overrides(["adamw_lr=1e-3"])).train.adamw_lr == 0.001
    with pytest.raises(ConfigError, match=r"moe_balance='off': choose one of 'ema', 'sign', 'none'"):
        load_config("hymo_tiny", **parse_overrides(["moe_balance=off"]))
    c = load_config("hymo_tiny", **parse_overrides(["run_dir=null", "moe_balance=none"]))
    assert (c.train.run_dir, c.model.moe_balance) == (None, "none")


@pytest.mark.parametrize("line, got", [("run_dir: 007", "int 7"), ("run_dir: 2024-12-05", "date"), ("wandb_project: off", "bool False")])
def test_text_in_a_yaml_file_that_yaml_reads_as_another_type_is_told_to_quote_it(tmp_path, line, got):
    (tmp_path / "t.yaml").write_text(f"base: hymo_tiny\ntrain:\n  {line}\n")
    with pytest.raises(ConfigError) as e: load_config(str(tmp_path / "t.yaml"))
    key = line.split(":")[0]
    assert f"expected str, got {got}" in str(e.value) and f"quote it ({key}: '...' in a YAML file)" in str(e.value)


def test_a_base_file_names_where_it_was_looked_for_and_a_bad_key_its_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "mybase.yaml").write_text("base: hymo_tiny\n")
    (tmp_path / "sub" / "child.yaml").write_text("base: mybase.yaml\n")
    with pytest.raises(ConfigError) as e: load_config(str(tmp_path / "sub" / "child.yaml"))
    assert f"child.yaml names 'base: mybase.yaml', which is not a file at {tmp_path / 'sub' / 'mybase.yaml'}" in str(e.value)
    (tmp_path / "sub" / "mybase.yaml").write_text("base: hymo_tiny\ntrain:\n  sedd: 1\n")
    with pytest.raises(ConfigError, match=r"sub/mybase.yaml: unknown key 'train.sedd'. Did you mean 'seed'"):
        load_config(str(tmp_path / "sub" / "child.yaml"))
    with pytest.raises(ConfigError, match=r"'hymo_tiny.yaml' \(a preset is named without .yaml: hymo_tiny\)"):
        load_config("hymo_tiny.yaml")


def test_the_design_defaults_note_follows_the_bases_to_the_last_file(tmp_path):
    "A chain of files ending in one without `base:` trains at hymo_750m's sizes too; one ending in a preset does not."
    from hymo.train import design_defaults_note
    (tmp_path / "root.yaml").write_text("train:\n  max_steps: 3\n")
    (tmp_path / "child.yaml").write_text("base: root.yaml\nmodel:\n  dim: 64\n")
    note = design_defaults_note(str(tmp_path / "child.yaml"))
    n = len(dataclasses.fields(ModelConfig)) + len(dataclasses.fields(TrainingConfig)) - 2  # all but dim and max_steps
    assert re.search(rf"child.yaml rests on .*root.yaml, which has no 'base:', so the {n} values they do not set are the "
                     r"design defaults .*add the line 'base: hymo_tiny' to .*root.yaml$", note), note
    (tmp_path / "root.yaml").write_text("base: hymo_tiny\ntrain:\n  max_steps: 3\n")
    assert design_defaults_note(str(tmp_path / "child.yaml")) is None


def test_a_near_miss_key_is_matched_even_when_it_is_a_part_of_the_name():
    with pytest.raises(ConfigError, match=r"unknown key 'batch_size'. Did you mean 'micro_batch_size'\?"):
        load_config("hymo_tiny", batch_size=8)


def test_a_wrong_type_in_a_base_file_names_that_file(tmp_path):
    "A wrong type in the value a file gave, and nothing replaced, is reported with that file, as an unknown key is."
    (tmp_path / "mybase.yaml").write_text("base: hymo_tiny\nmodel:\n  dim: 'wide'\n")
    (tmp_path / "child.yaml").write_text("base: mybase.yaml\n")
    with pytest.raises(ConfigError) as e: load_config(str(tmp_path / "child.yaml"))
    assert str(e.value).startswith(f"{tmp_path / 'mybase.yaml'}: model.dim: expected int, got str 'wide'")
    (tmp_path / "child.yaml").write_text("base: mybase.yaml\ntrain:\n  max_steps: 1.0e+3\n")
    with pytest.raises(ConfigError) as e: load_config(str(tmp_path / "child.yaml"))  # the base's error is found first
    assert str(e.value).startswith(f"{tmp_path / 'mybase.yaml'}:")
    (tmp_path / "mybase.yaml").write_text("base: hymo_tiny\n")
    with pytest.raises(ConfigError) as e: load_config(str(tmp_path / "child.yaml"))
    assert str(e.value) == (f"{tmp_path / 'child.yaml'}: train.max_steps: expected int, got float 1000.0; "
                            f"write it as a whole number: 1000")
    (tmp_path / "child.yaml").write_text("base: mybase.yaml\ntrain:\n  max_steps: 1000\n  muon_lr: 1\n")
    cfg = load_config(str(tmp_path / "child.yaml"))
    assert cfg.train.max_steps == 1000 and cfg.train.muon_lr == 1.0 and type(cfg.train.muon_lr) is float
    # a wrong value that a later file or the command line replaces is no error, as before
    (tmp_path / "mybase.yaml").write_text("base: hymo_tiny\nmodel:\n  dim: 'wide'\n")
    (tmp_path / "child.yaml").write_text("base: mybase.yaml\nmodel:\n  dim: 64\n")
    assert load_config(str(tmp_path / "child.yaml")).model.dim == 64
    assert load_config(str(tmp_path / "mybase.yaml"), dim=96).model.dim == 96


# Found by mutation testing (each fails on a mutant of hymo/config.py that the tests above let pass)
def test_e_notation_with_a_capital_E_is_a_float(tmp_path):
    "YAML 1.1 (PyYAML) reads 1E-3 as text, like 1e-3; both must reach the float field as 0.001."
    assert load_config("hymo_tiny", adamw_lr="1E-3").train.adamw_lr == 0.001
    p = tmp_path / "cap.yaml"
    p.write_text("base: hymo_tiny\ntrain:\n  muon_lr: 2E-2\n")
    assert load_config(str(p)).train.muon_lr == 0.02


def test_an_empty_wandb_project_does_not_suggest_null():
    "wandb_project is plain str (null is refused), so its message must not offer 'null for the default' as data_dir's does."
    with pytest.raises(ConfigError) as e: load_config("hymo_tiny", wandb_project=" ")
    assert str(e.value) == "train.wandb_project=' ' is empty: give a value"
    with pytest.raises(ConfigError, match="or null for the default"): load_config("hymo_tiny", data_dir=" ")


def test_warmup_suggestion_is_at_least_one_step_when_the_stable_phase_is_short():
    "With the decay starting at step 5, decay_start // 10 is 0; the suggestion keeps one warmup step."
    with pytest.raises(ConfigError, match=r"e\.g\. warmup_steps=1\)"):
        load_config("hymo_tiny", max_steps=10, decay_fraction=0.5, warmup_steps=6)


def test_a_wrong_override_is_not_blamed_on_the_preset_that_also_sets_the_key():
    "hymo_tiny.yaml sets max_steps; a bad max_steps from the command line is the command line's error, not the file's."
    with pytest.raises(ConfigError) as e: load_config("hymo_tiny", max_steps="ten")
    assert str(e.value).startswith("train.max_steps: expected int, got str 'ten'")
    assert "hymo_tiny.yaml" not in str(e.value)


def test_to_dict_holds_lists_not_tuples():
    "to_dict is 'plain' and YAML-ready: tuples become lists, so it equals the YAML a run folder's config.yaml reads back."
    d = load_config("hymo_tiny", nope_layers=[3]).to_dict()
    assert type(d["model"]["mtp_loss_weights"]) is list and type(d["model"]["nope_layers"]) is list
    assert type(d["train"]["adamw_betas"]) is list
    assert d["model"]["mtp_loss_weights"] == [0.3, 0.1]


def test_a_train_key_at_the_top_level_of_a_file_is_refused(tmp_path):
    "A key written without its section (seed: 1 at column 0) is not silently dropped."
    p = tmp_path / "flat.yaml"
    p.write_text("base: hymo_tiny\nseed: 1\n")
    with pytest.raises(ConfigError, match=r"has the sections .*found \['base', 'seed'\]"):
        load_config(str(p))


@pytest.mark.parametrize("depth, example", [(0, "[]"), (1, "[0.3]"), (3, "[0.3,0.1,0.1]")])
def test_a_changed_mtp_depth_says_which_weights_to_give(depth, example):
    "mtp_depth=0 alone was refused without the override that fits; the example given is one that loads."
    with pytest.raises(ConfigError, match=re.escape(f"e.g. model.mtp_loss_weights={example}")):
        load_config("hymo_tiny", mtp_depth=depth)
    assert load_config("hymo_tiny", mtp_depth=depth, mtp_loss_weights=yaml.safe_load(example)).model.mtp_depth == depth


def test_configs_the_model_cannot_train_are_refused():
    "One routed expert (its weight always 1: no router gradient) and rope_theta <= 1 (frequencies not falling) passed."
    from hymo.config import ConfigError
    with pytest.raises(ConfigError, match="moe_n_routed=1: with one routed expert"): load_config("hymo_tiny", moe_n_routed=1, moe_top_k=1)
    for theta in (1, 0.5):
        with pytest.raises(ConfigError, match=f"rope_theta={float(theta)} must be above 1"): load_config("hymo_tiny", rope_theta=theta)
    assert load_config("hymo_tiny", moe_n_routed=2, moe_top_k=1).model.moe_n_routed == 2


def test_integers_are_read_as_yaml_1_2_writes_them(tmp_path):
    "PyYAML (YAML 1.1) read seed=0123 as octal 83 and 2:00 as 120, without a word; hex and underscores still work."
    from hymo.train import parse_overrides
    assert parse_overrides(["seed=0123", "max_steps=1_000", "dim=0x40", "eval_every=0o17", "log_every=-0"]) == \
        {"seed": 123, "max_steps": 1000, "dim": 64, "eval_every": 15, "log_every": 0}
    with pytest.raises(ConfigError, match=r"train.max_steps: expected int, got str '2:00'"):
        load_config("hymo_tiny", **parse_overrides(["max_steps=2:00"]))
    (tmp_path / "c.yaml").write_text("base: hymo_tiny\ntrain:\n  seed: 0123\n  max_steps: 0200\n")
    c = load_config(str(tmp_path / "c.yaml"))
    assert (c.train.seed, c.train.max_steps) == (123, 200)


def test_type_errors_of_words_lists_and_grouped_numbers_say_what_to_write(tmp_path):
    from hymo.train import parse_overrides
    (tmp_path / "off.yaml").write_text("base: hymo_tiny\nmodel:\n  moe_balance: off\n")
    with pytest.raises(ConfigError, match=r"model.moe_balance: expected str, got bool False; choose one of 'ema', 'sign', "
                                          r"'none' \(off is the word none\)$"):
        load_config(str(tmp_path / "off.yaml"))
    with pytest.raises(ConfigError, match=r"write it as a list: \[0.9,0.95\]$"):
        load_config("hymo_tiny", **parse_overrides(["adamw_betas=(0.9,0.95)"]))
    with pytest.raises(ConfigError, match=r"write it without commas: 1000 \(or with underscores, 1_000\)$"):
        load_config("hymo_tiny", **parse_overrides(["max_steps=1,000"]))
    with pytest.raises(ConfigError, match=r"train.muon_lr=1000.*: too large for a float"):
        load_config("hymo_tiny", muon_lr=10 ** 400)


def test_a_run_name_must_name_a_folder_and_paths_are_checked_plainly(tmp_path):
    for name in ("../../escape", "[a]", "''", "a/b"):
        (tmp_path / "n.yaml").write_text(f"base: hymo_tiny\nname: {name}\n")
        with pytest.raises(ConfigError, match=r"'name:' names the run .* without / or"):
            load_config(str(tmp_path / "n.yaml"))
    (tmp_path / "n.yaml").write_text("base: hymo_tiny\nname: my-run.2\n")
    assert load_config(str(tmp_path / "n.yaml")).name == "my-run.2"
    (tmp_path / "UP.YAML").write_text("base: hymo_tiny\n")
    assert load_config(str(tmp_path / "UP.YAML")).model.dim == load_config("hymo_tiny").model.dim
    with pytest.raises(ConfigError, match=r"the config is '': give a preset"):
        load_config("")
    (tmp_path / "e.yaml").write_text("base: ''\n")
    with pytest.raises(ConfigError, match=r"e.yaml: 'base:' is '': give a preset"):
        load_config(str(tmp_path / "e.yaml"))
    (tmp_path / "mybase.yaml").write_text("base: hymo_tiny\n")
    (tmp_path / "child.yaml").write_text("base: mybase\n")
    with pytest.raises(ConfigError, match=r"names 'base: mybase', which is not a preset .*; for the file beside it, write 'base: mybase.yaml'$"):
        load_config(str(tmp_path / "child.yaml"))


def test_the_weight_decay_refusal_also_names_the_learning_rate_and_unused_ema_decay_passes():
    with pytest.raises(ConfigError, match=r"give weight_decay < 0.05, or check muon_lr \(usual: muon_lr 0.02"):
        load_config("hymo_tiny", muon_lr=20)
    assert load_config("hymo_tiny", moe_balance="none", moe_ema_decay=1.0).model.moe_ema_decay == 1.0  # unused there
    with pytest.raises(ConfigError, match=r"moe_ema_decay=1.0 must be in \[0, 1\)"):
        load_config("hymo_tiny", moe_balance="ema", moe_ema_decay=1.0)


def test_a_run_config_reads_back_as_written_and_odd_numbers_are_text(tmp_path):
    "A text value YAML 1.1 writes unquoted but 1.2 reads as a number (0o17) came back as 15; 0o_ was a raw ValueError."
    from hymo.train import parse_overrides
    for v in ("0o17", "+0o7", "0o_", "0x_", "1:30.5", "0123", "12:30"):
        c = load_config("hymo_tiny", data_dir=v, run_dir=v)
        (tmp_path / "c.yaml").write_text(str(c))
        back = load_config(str(tmp_path / "c.yaml"))
        assert (back.train.data_dir, back.train.run_dir) == (v, v), v
    assert parse_overrides(["seed=0o_", "eval_every=1:30.5", "warmup_steps=0b101"]) == \
        {"seed": "0o_", "eval_every": "1:30.5", "warmup_steps": "0b101"}  # text: refused below as not an int, no traceback
    with pytest.raises(ConfigError, match=r"train.seed: expected int, got str '0o_'"):
        load_config("hymo_tiny", **parse_overrides(["seed=0o_"]))
    with pytest.raises(ConfigError, match=r"got int 0; choose one of 'ema', 'sign', 'none'$"):
        load_config("hymo_tiny", moe_balance=0)
    for name in ("2024", "2024-06-01", "1.5"):  # numbers and dates name a run as their text, as before
        (tmp_path / "n.yaml").write_text(f"base: hymo_tiny\nname: {name}\n")
        assert load_config(str(tmp_path / "n.yaml")).name == name
    (tmp_path / "sub").mkdir(); (tmp_path / "sub" / "mybase.yaml").write_text("base: hymo_tiny\n")
    (tmp_path / "child.yaml").write_text("base: sub/mybase\n")
    with pytest.raises(ConfigError, match=r"names 'base: sub/mybase', which is not a preset .*write 'base: sub/mybase.yaml'$"):
        load_config(str(tmp_path / "child.yaml"))


def test_an_empty_override_is_told_a_fix_that_is_accepted():
    "'max_steps=' advised 'max_steps=null for the default', which was then refused (expected int, got NoneType None)."
    from hymo.train import parse_overrides
    for key in ("max_steps", "dim", "muon_lr", "wandb", "data_dir", "moe_capacity_factor"):
        with pytest.raises(ConfigError) as e: parse_overrides([f"{key}="])
        if f"{key}=null" in str(e.value): load_config("hymo_tiny", **parse_overrides([f"{key}=null"]))  # the advice works
        else: assert str(e.value).endswith("or leave it out to keep the config's value"), str(e.value)
    assert "data_dir=null for the default" in str(pytest.raises(ConfigError, parse_overrides, ["data_dir="]).value)
    assert "leave it out" in str(pytest.raises(ConfigError, parse_overrides, ["moe_capacity_factor="]).value)  # null: dropless


def test_near_misses_of_a_preset_infinity_and_a_scalar_list_get_their_fix():
    for wrong in ("hymo-tiny", "hymo_tyni", "tiny"):
        with pytest.raises(ConfigError, match=r"\. Did you mean 'hymo_tiny'\? Presets: "): load_config(wrong)
    for inf in ("inf", "Infinity", "+inf"):  # the cap off is null (YAML's .inf, a float, is not finite: refused as such)
        with pytest.raises(ConfigError, match=r"moe_capacity_factor=.*: for no limit write null"):
            load_config("hymo_tiny", moe_capacity_factor=inf)
        assert load_config("hymo_tiny", run_dir=inf, data_dir=inf, sample_prompt=inf).train.run_dir == inf  # text: a name
    with pytest.raises(ConfigError, match=r"write it as a list in brackets, \[0.9, \.\.\.\], as many values as it takes$"):
        load_config("hymo_tiny", adamw_betas=0.9)  # [0.9] alone was advised, and refused in turn (two numbers)


def test_commands_in_messages_paste_into_a_shell_with_spaces_in_paths(tmp_path):
    "Paths in the commands messages suggest are quoted for the shell (a run folder or dataset under 'my runs')."
    import shlex
    from hymo.generate import write_again
    from hymo.training.data import DataError, load_manifest
    run = tmp_path / "my runs" / "r"
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    argv = shlex.split(write_again(run).split(" writes the missing files")[0])
    assert argv[argv.index("--config") + 1] == str(run / "config.yaml") and f"run_dir={run}" in argv, argv
    text = tmp_path / "my texts" / "a.txt"
    text.parent.mkdir(); text.write_text("hello\n")
    with pytest.raises(DataError) as e: load_manifest(text)
    command = str(e.value).split("`")[1]
    argv = shlex.split(command)
    assert argv[argv.index("--input") + 1] == str(text) and (tmp_path / "my texts").samefile(Path(argv[argv.index("--out") + 1]).parent), argv


def _print_config(capsys, *argv) -> tuple[str, str]:
    "`python -m hymo.train ARGV --print-config`'s (stdout, stderr)."
    from hymo.train import main
    assert main([*argv, "--print-config"]) == {}
    out = capsys.readouterr()
    return out.out, out.err


def test_print_config_prints_a_file_that_reads_back_and_what_it_trains(tmp_path, capsys, monkeypatch):
    """`--print-config` prints the settings as YAML that `--config` reads back (data_dir absolute, as config.yaml has it),
    and in comments what they make; it writes nothing: no runs/ folder, no data prepared."""
    import torch
    from hymo.models.model import HyMo
    from hymo.train import _count
    monkeypatch.chdir(tmp_path)
    out, err = _print_config(capsys, "--config", "hymo_750m", "max_steps=100", "warmup_steps=10", "data_dir=nowhere")
    assert list(tmp_path.iterdir()) == []  # nothing written
    (tmp_path / "run.yaml").write_text(out)
    back = load_config(str(tmp_path / "run.yaml"))
    assert back.to_dict() == load_config("hymo_750m", max_steps=100, warmup_steps=10, data_dir=str(tmp_path / "nowhere")).to_dict()
    assert back.name == "hymo_750m"
    with torch.device("meta"): model = HyMo(back.model)
    comments = [l for l in out.splitlines() if l.startswith("#")]
    assert comments[0] == "# the settings of: python -m hymo.train --config hymo_750m max_steps=100 warmup_steps=10 data_dir=nowhere --print-config"
    assert "# 32 blocks: 24 Gated DeltaNet + SwiGLU, 8 MLA + MoE (16 routed experts, top 2, 1 shared); 2 MTP heads" in comments
    assert (f"# {_count(model.num_params())} parameters stored, {_count(model.num_params(active=True))} active per token; "
            f"{model.flops_per_token(4096) / 1e9:.3g} GFLOPs per training token") in comments
    assert _count(model.num_params()) == "1.24B" and _count(917_504) == "918K" and _count(12) == "12"
    assert (_count(999_999), _count(999_499), _count(0)) == ("1M", "999K", "0")
    assert ("# 524,288 tokens a step (128 sequences of 4096: 32 micro-batches of 4 on each of 1 process), "
            "52.4M tokens in 100 steps") in comments
    assert f"# data: not ready: {tmp_path / 'nowhere'} does not exist" in out and "# run folder: a new folder, runs/hymo_750m-" in out
    assert err.startswith(f"warning: the data is not ready: {tmp_path / 'nowhere'} does not exist"), err


def test_print_config_checks_the_split_over_ranks_and_says_notes_on_stderr(tmp_path, capsys, monkeypatch):
    from hymo.train import main
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as e: main(["--config", "hymo_750m", "--print-config"])
    assert e.value.code == 2 and "which do not split over 3 ranks" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "8")
    out, _ = _print_config(capsys, "--config", "hymo_750m")
    assert "(128 sequences of 4096: 4 micro-batches of 4 on each of 8 processes)" in out
    monkeypatch.delenv("WORLD_SIZE")
    bare = tmp_path / "bare.yaml"  # no base: the design defaults, with a note: on stderr, so stdout is still YAML
    bare.write_text("model:\n  dim: 64\n")
    out, err = _print_config(capsys, "--config", str(bare))
    assert "has no 'base:'" in err and "has no 'base:'" not in out
    assert yaml.safe_load(out)["model"]["dim"] == 64


def test_print_config_says_where_the_run_goes(tmp_path, capsys):
    "A run folder with checkpoints is continued (the newest named), --no-resume is refused there, a run's config.yaml continues it."
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True); (run / "checkpoints" / "step_000010").mkdir()
    out, _ = _print_config(capsys, f"run_dir={run}")
    assert f"# run folder: {run}, continuing from step_000010" in out
    out, _ = _print_config(capsys, f"run_dir={run}", "--no-resume")
    assert f"# run folder: {run} (but --no-resume refuses a folder that holds checkpoints)" in out
    out, _ = _print_config(capsys, f"run_dir={run}", "max_steps=10", "warmup_steps=1")
    assert f"# run folder: {run}, finished at step 10: nothing to train (raise max_steps to train further)" in out
    (tmp_path / "a_file").write_text("x"); (tmp_path / "theirs").mkdir(); (tmp_path / "theirs" / "notes.txt").write_text("x")
    out, _ = _print_config(capsys, f"run_dir={tmp_path / 'a_file'}")
    assert f"# run folder: {tmp_path / 'a_file'} (but it is a file: training refuses it)" in out
    out, _ = _print_config(capsys, f"run_dir={tmp_path / 'theirs'}")
    assert f"# run folder: {tmp_path / 'theirs'} (but it holds files and is no HyMo run folder: training refuses it)" in out
    out, _ = _print_config(capsys, f"run_dir={run}", "--resume", str(run / "checkpoints" / "step_000002"))
    assert f"# run folder: {run}, from {run / 'checkpoints' / 'step_000002'} (but {run / 'checkpoints' / 'step_000002'} is no " \
           "checkpoint: training would refuse it)" in out  # (an empty folder here)
    (run / "checkpoints" / "step_000002" / "meta.json").write_text("{}")
    out, _ = _print_config(capsys, f"run_dir={run}", "--resume", str(run / "checkpoints" / "step_000002"))
    assert f"# run folder: {run}, from {run / 'checkpoints' / 'step_000002'}\n" in out
    out, _ = _print_config(capsys, f"run_dir={tmp_path / 'new'}")
    assert f"# run folder: {tmp_path / 'new'}, from step 0" in out and not (tmp_path / "new").exists()
    (run / "config.yaml").write_text(str(load_config("hymo_tiny")))  # run_dir: null, as a copied config may have
    out, err = _print_config(capsys, "--config", str(run / "config.yaml"))
    assert "continuing that run" in err and yaml.safe_load(out)["train"]["run_dir"] == str(run)
    assert f"# run folder: {run}, continuing from step_000010" in out


def test_print_config_names_the_data_and_the_epochs_it_reads(tmp_path, capsys):
    from hymo.training.data import CORPUS, load_manifest, prepare
    text = tmp_path / "play.txt"
    text.write_text(CORPUS.read_text()[:20_000])
    ds = prepare(text, tmp_path / "data", vocab_size=300, progress=False)
    tokens = load_manifest(ds)["splits"]["train"]["tokens"]
    windows = (tokens - 1) // 128  # of 128 + 1 tokens (the targets shifted by one), each token in one window
    out, err = _print_config(capsys, f"data_dir={ds}", "max_steps=10", "warmup_steps=1", "global_batch_size=32")
    epochs = 10 / (windows // 32)  # whole optimiser steps of 32 windows an epoch
    assert (f"# data: {ds} ({tokens:,} training tokens, {windows:,} windows of seq_len 128, a vocabulary of 300): "
            f"max_steps=10 reads {epochs:.3g} epochs") in out
    assert err == ""
    out, err = _print_config(capsys, f"data_dir={ds}", "global_batch_size=256")  # more windows than the split has
    assert f"# data: not ready: the train split has {windows} windows of seq_len=128, fewer than the 256" in out, out
    assert "warning: the data is not ready" in err
    out, err = _print_config(capsys, f"data_dir={ds}", "vocab_size=257")  # fewer rows than the dataset's ids
    assert f"# data: not ready: {ds} was tokenized with 300 tokens but the model has vocab_size=257" in out
    assert "warning: the data is not ready" in err


@pytest.mark.parametrize("world", ["0", "-1", "abc", ""])
def test_print_config_refuses_a_world_size_that_is_no_count(world, capsys, monkeypatch):
    from hymo.train import main
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as e: main(["--print-config"])
    assert e.value.code == 2 and f"WORLD_SIZE={world!r} must be a whole number >= 1" in capsys.readouterr().err


def test_print_config_of_one_process_prints_whatever_rank_says_and_reads_back_any_argument(tmp_path, capsys, monkeypatch):
    "A stray RANK without WORLD_SIZE is one process (as training runs it); an argument with a line break stays one comment line."
    monkeypatch.setenv("RANK", "1")
    out, _ = _print_config(capsys, "sample_prompt=ROMEO:\nJULIET:\u2028\tX")
    assert out.startswith("# the settings of: python -m hymo.train 'sample_prompt=ROMEO:\\nJULIET:\\u2028\\tX'")
    (tmp_path / "x.yaml").write_text(out)
    assert load_config(str(tmp_path / "x.yaml")).train.sample_prompt == "ROMEO:\nJULIET:\u2028\tX"
    monkeypatch.setenv("WORLD_SIZE", "2")  # rank 1 of 2: rank 0 prints
    assert _print_config(capsys, "micro_batch_size=8")[0] == ""


def test_print_config_of_a_folder_it_cannot_read_leaves_it_to_training(tmp_path, capsys, monkeypatch):
    "A run folder it may not list (EACCES; simulated: root lists any) is no traceback: training's own checks say why."
    d = tmp_path / "locked"; d.mkdir(); (d / "x").write_text("x")
    listing = Path.iterdir
    def refuse(self):
        if self == d: raise PermissionError(13, "Permission denied", str(self))
        return listing(self)
    monkeypatch.setattr(Path, "iterdir", refuse)
    out, _ = _print_config(capsys, f"run_dir={d}")
    assert f"# run folder: {d}, from step 0" in out
