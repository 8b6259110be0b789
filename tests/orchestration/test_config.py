import pytest

from neorec.orchestration.config import load_config
from neorec.trainer.config import ConfigError


def _write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_demo_config_loads_with_overrides():
    config = load_config("configs/demo.toml", ["train.batch_size=128", "optimizer.sparse=adagrad",
                                               "model.top_mlp=[8, 4, 1]"])
    assert config.train.batch_size == 128
    assert config.optimizer.sparse == "adagrad"
    assert config.model.top_mlp == [8, 4, 1]


@pytest.mark.parametrize("text,message", [
    ("[train]\nbach_size = 3\n", "unknown key 'train.bach_size'"),
    ("[trian]\n", "unknown key 'trian'"),
    ("[train]\nbatch_size = 'x'\n", "train.batch_size: expected an integer"),
    ("[train]\nbatch_size = 0\n", "train.batch_size: must be positive"),
    ("[model]\ntop_mlp = [1, 'a']\n", r"model.top_mlp\[1\]: expected an integer"),
    ("[optimizer]\nsparse = 'lamb'\n", "optimizer.sparse: must be one of"),
    ("[data]\nremainder = 'keep'\n", "data.remainder: must be one of"),
    ("[train\n", "not valid TOML"),
    ("[sharding]\nmemory_per_rank = 'lots'\n", "sharding.memory_per_rank: not a size"),
    ("[sharding]\ntables = { t_C1 = 'diagonal' }\n", "sharding.tables.t_C1: .*unknown sharding type 'diagonal'"),
    ("[sharding]\ntables = { t_C1 = 3 }\n", "sharding.tables.t_C1: expected a string"),
    ("[sharding]\ntables = 'row_wise'\n", "sharding.tables: expected a table of keys"),
    ("[model.dynamic]\nt_C1 = 5\n", "^[^ ]+: model.dynamic.t_C1: expected a table of keys, got 5$"),
    ("[data]\ningest = ['127.0.0.1:1']\n[train]\neval_batch_size = 2000000\n",
     "train.eval_batch_size: a reader service cuts batches of at most 1,048,576 rows, got 2,000,000"),
])
def test_bad_config_names_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, text))


def test_a_config_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xff\xfe[train]\n")  # UTF-16's byte order mark
    with pytest.raises(ConfigError, match=r"bom.toml: not UTF-8 text \(byte 0: b'\\xff'\); TOML files are UTF-8"):
        load_config(path)


def test_sharding_overrides_load():
    config = load_config("configs/demo.toml", ["sharding.tables={t_C1='row_wise', t_C2='table_wise:1'}"])
    assert config.sharding.tables == {"t_C1": "row_wise", "t_C2": "table_wise:1"}


def test_bad_override_is_named(tmp_path):
    with pytest.raises(ConfigError, match="train.epochs: expected an integer"):
        load_config(_write(tmp_path, ""), ["train.epochs=1.5"])
    path = _write(tmp_path, "[train]\nbatch_size = 64\n")
    for overrides, where in [(["train.batch_size=-1"], "--set train.batch_size=-1: train.batch_size"),
                             (["train.epochs=2", "train.bach_size=3"], "--set train.bach_size=3: unknown key"),
                             (["trian.epochs=2"], "--set trian.epochs=2: unknown key 'trian'"),
                             (["model.top_mlp=[8, 'a', 1]"], r"--set model.top_mlp=\[8, 'a', 1\]: model.top_mlp\[1\]")]:
        with pytest.raises(ConfigError, match=f"^{where}"):  # not the file, which holds none of it
            load_config(path, overrides)
    with pytest.raises(ConfigError, match=f"^{path}: train.batch_size: must be positive"):
        load_config(_write(tmp_path, "[train]\nbatch_size = 0\n"), ["train.epochs=2"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(_write(tmp_path, ""), ["train.epochs"])


def test_mlp_stacks_that_do_not_end_as_torchrec_s_are_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nembedding_dim = 16\nbottom_mlp = [64, 32]\n")
    with pytest.raises(ConfigError, match=r"model.bottom_mlp: .* must end with model.embedding_dim \(16\).*\[64, 32, 16\]"):
        load_config(path)
    path.write_text("[model]\ntop_mlp = [128, 64]\n")
    with pytest.raises(ConfigError, match=r"model.top_mlp: .* must end with 1 .*\[128, 64, 1\]"):
        load_config(path)
    path.write_text("[model]\ninit = 'xavier'\n")
    with pytest.raises(ConfigError, match="model.init: must be one of normal, uniform"):
        load_config(path)
    path.write_text("[data]\nshuffle = true\n")
    with pytest.raises(ConfigError, match="data.shuffle: expected a string"):
        load_config(path)


def test_the_shipped_configs_load():
    for path in ("configs/demo.toml", "configs/job.toml"):
        config = load_config(path)
        assert config.model.bottom_mlp[-1] == config.model.embedding_dim
    assert load_config("configs/job.toml").launch.ingest_workers == 2


@pytest.mark.parametrize("seed", ["-1", str(2**63), "99999999999999999999"])
def test_a_seed_torch_and_numpy_cannot_take_is_refused(seed):
    with pytest.raises(ConfigError, match=r"train.seed: must lie in \[0, 2\*\*63\)"):
        load_config("configs/demo.toml", [f"train.seed={seed}"])


def test_ranks_per_node_must_divide_the_ranks():
    from neorec.trainer.planner.from_config import topology

    config = load_config("configs/demo.toml", ["sharding.ranks_per_node=3"])
    assert topology(config, 6).ranks_per_node == 3
    with pytest.raises(ConfigError, match="sharding.ranks_per_node: 2 ranks do not split into nodes of 3 ranks"):
        topology(config, 2)


def test_group_size_must_divide_the_ranks_and_memory_per_rank_be_some():
    from neorec.trainer.planner.from_config import topology

    config = load_config("configs/demo.toml", ["sharding.group_size=3"])
    assert topology(config, 6).group_size == 3
    with pytest.raises(ConfigError, match="sharding.group_size: 2 ranks do not split into table_row_wise groups of 3"):
        topology(config, 2)
    for memory in ("0", "0GiB"):
        with pytest.raises(ConfigError, match=f"sharding.memory_per_rank: must be more than 0 bytes, got '{memory}'"):
            load_config("configs/demo.toml", [f"sharding.memory_per_rank='{memory}'"])
