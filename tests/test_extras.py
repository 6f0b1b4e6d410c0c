"""Single-feature dependencies (config/extras.py): a feature asked for without its package is one line
naming the pip command, exit code 2, before anything starts.

Every extra is installed where the suite runs (`make`), so a missing one is simulated by the
check's own lookup answering "not installed" for that package; the commands are run in this process.
"""

from __future__ import annotations

import pytest

from a3po import cli
from a3po.config import ConfigError, extras, load_config


def missing(*packages: str):
    return lambda package: package not in packages


def test_the_line_names_the_feature_the_package_and_the_pip_command():
    assert extras.missing_line("lora", "actor.lora.rank=16") == (
        "actor.lora.rank=16 needs the peft package, which is not installed here: pip install 'a3po[lora]'")
    assert set(extras.PACKAGES) == {"plots", "agents", "lora", "textarena"}


def test_a_configuration_needs_openai_for_an_agent_textarena_for_its_games_and_peft_only_to_train_adapters():
    agent = load_config(None, ["train_dataset.agent=my_agent:run"])
    lora = load_config(None, ["actor.lora.rank=4"])
    with pytest.raises(ConfigError, match=r"^train_dataset.agent=my_agent:run needs the openai package, .*"
                                          r"pip install 'a3po\[agents\]'$"):
        extras.check(agent, have=missing("openai"))
    with pytest.raises(ConfigError, match=r"^actor.lora.rank=4 needs the peft package"):
        extras.check(lora, have=missing("peft"))
    extras.check(lora, training=False, have=missing("peft"))  # `a3po eval` folds a saved adapter without peft
    extras.check(load_config(None, []), have=missing("openai", "peft", "matplotlib", "textarena"))  # none needed
    game = load_config(None, ["train_dataset.env=textarena", "train_dataset.env_id=GuessTheNumber-v0"])
    with pytest.raises(ConfigError, match=r"^train_dataset.env=textarena needs the textarena package, .*"
                                          r"pip install 'a3po\[textarena\]'$"):
        extras.check(game, training=False, have=missing("textarena"))  # `a3po eval` plays the game too


@pytest.mark.parametrize("argv, line", [
    (["train", "--preset", "tiny", "actor.lora.rank=4"],
     "a3po: error: actor.lora.rank=4 needs the peft package, which is not installed here: pip install 'a3po[lora]'"),
    (["bench", "staleness", "--preset", "tiny"],
     "a3po: config error: a3po bench staleness needs the matplotlib package, which is not installed here: "
     "pip install 'a3po[plots]'"),
])
def test_a_command_asking_for_a_missing_extra_is_one_line_and_exit_2(argv, line, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(extras, "installed", missing("peft", "matplotlib"))
    assert cli.main(argv) == 2
    out = capsys.readouterr()
    assert out.err.splitlines() == [line] and out.out == ""
    assert not (tmp_path / "runs").exists()  # refused before anything was written
