"""TextArena's games as environments (envs/textarena.py), on real games of the installed library.

Proves: the model sees the game's opening as its first prompt and, after each move, only what
the game said since (never its own move echoed, never the history again); the game's end and
its reward for player 0 become the episode's (a win 1, a lost game its partial credit, invalid
moves answered and then ending the game); an example seeds its game, so replaying the moves
rebuilds the episode exactly (what a replaced environment process does), a game's draws during
play do not depend on other episodes' moves in between, and different examples give different
games; the configuration names a missing game, a misspelt one and a two-player
one in one line each, and checking a game leaves this process's random generator alone.
The extra's absence is tests/test_extras.py's; a run training a game is tests/test_episodes_e2e.py's.
"""

import functools
import random
import re

import pytest

pytest.importorskip("textarena", reason="the textarena extra is not installed (make installs it)")

from a3po.config import ConfigError, load_config  # noqa: E402
from a3po.data import DataError, Example  # noqa: E402
from a3po.envs import build_env  # noqa: E402
from a3po.envs.host import RESET, STEP, EnvHost  # noqa: E402
from a3po.envs.textarena import TextArenaEnv  # noqa: E402

GAME = "GuessTheNumber-v0"  # 1 to 20, about ten guesses, a guess is a number in square brackets


def example(i: int = 0) -> Example:
    return Example(f"What is {i} + 1?", str(i + 1), i)


def secret(env: TextArenaEnv) -> int:
    return env.game.game_number


def test_a_won_game_shows_each_hint_alone_and_rewards_1_at_its_end():
    env = TextArenaEnv(example(), GAME)
    prompt = env.reset()
    assert prompt.startswith("You are Player 0. You are playing Guess The Number.") and "[5]" in prompt
    low, high, seen = 1, 20, []
    for _ in range(5):  # halving 1..20 finds any number in five guesses
        guess = (low + high) // 2
        step = env.step(f"My guess is [{guess}].")
        if step.done:
            break
        seen.append(step.observation)
        assert step.reward == 0.0
        low, high = (guess + 1, high) if step.observation == "The target number is higher." else (low, guess - 1)
    assert step.done and step.reward == 1.0 and guess == secret(env)
    assert all(o in ("The target number is higher.", "The target number is lower.") for o in seen), seen


def test_invalid_moves_are_answered_then_end_the_game_and_a_lost_game_keeps_its_partial_credit():
    env = TextArenaEnv(example(), GAME)
    env.reset()
    first = env.step("twelve")  # no [number]: the game's one allowed invalid move
    assert not first.done and first.observation.startswith("You attempted an invalid move.")
    assert "twelve" not in first.observation  # the move itself is the model's own message, not observed
    second = env.step("still no number")
    assert second.done and second.reward == 0.0  # no guess made: no credit

    env = TextArenaEnv(example(), GAME)
    env.reset()
    wrong, steps = [n for n in range(1, 21) if n != secret(env)], []
    while not (steps and steps[-1].done):  # wrong guesses until the game's own turn limit ends it
        steps.append(env.step(f"[{wrong[len(steps)]}]"))
    assert 10 <= len(steps) <= 11 and all(s.reward == 0.0 for s in steps[:-1])
    last = wrong[len(steps) - 1]
    assert steps[-1].reward == pytest.approx(1 - abs(last - secret(env)) / 19) and 0 < steps[-1].reward < 1


def test_an_example_seeds_its_game_so_a_fresh_process_rebuilds_an_episode_by_replaying_it():
    moves = ("[10]", "[3]", "oops")
    first = EnvHost(functools.partial(TextArenaEnv, game_id=GAME))
    prompt, _ = first(RESET, "e", example(7))
    steps = [first(STEP, "e", example(7), moves[:k])[0] for k in range(1, len(moves) + 1)]
    fresh = EnvHost(functools.partial(TextArenaEnv, game_id=GAME))  # holds no episode: rebuilds it from the moves
    assert fresh(STEP, "e", example(7), moves)[0] == steps[-1]
    assert prompt == TextArenaEnv(example(8), GAME).reset()
    games = set()
    for i in range(20):
        env = TextArenaEnv(example(i), GAME)
        env.reset()
        games.add(secret(env))
    assert len(games) >= 8, games  # twenty examples, not one game


def test_a_game_that_draws_during_play_repeats_its_draws_however_episodes_interleave():
    moves = ["[Up]", "[Left]", "[Down]", "[Right]"] * 2
    alone = TextArenaEnv(example(3), "2048-v0")
    boards = [alone.reset()] + [alone.step(m).observation for m in moves]
    env, other = TextArenaEnv(example(3), "2048-v0"), TextArenaEnv(example(4), "2048-v0")
    mixed = [env.reset()]
    other.reset()
    for m in moves:  # another episode's moves draw from the same generator in between
        other.step(m)
        random.random()
        mixed.append(env.step(m).observation)
    assert mixed == boards
    assert len(set(boards)) > 4  # new tiles appeared: the game did draw


def spec(*overrides: str):
    cfg = load_config(None, ["train_dataset.env=textarena", *overrides])
    return build_env(cfg.train_dataset, None, None)


def test_the_configuration_names_the_game_and_refuses_what_cannot_be_played():
    state = random.getstate()
    made = spec(f"train_dataset.env_id={GAME}")
    assert random.getstate() == state  # a game was started to check it, with the process's generator restored
    assert made.name == "textarena" and made.discount == 1.0 and made.stop == ()
    assert made.factory(example()).reset().startswith("You are Player 0")
    with pytest.raises(ConfigError, match=r"train_dataset.env_id=None .*set with train_dataset.env=textarena"):
        load_config(None, ["train_dataset.env=textarena"])
    with pytest.raises(ConfigError, match=r"train_dataset.env_id.*only read with train_dataset.env=textarena"):
        load_config(None, ["train_dataset.env=retry", f"train_dataset.env_id={GAME}"])
    with pytest.raises(DataError, match=re.escape("is not a TextArena game (did you mean 'GuessTheNumber-v0'?)")):
        spec("train_dataset.env_id=GuessTheNumbr-v0")
    with pytest.raises(DataError, match=r"^train_dataset.env_id='TicTacToe-v0' did not start as a one-player game "
                                        r"\(AssertionError: .*\); a3po plays TextArena's single-player games"):
        spec("train_dataset.env_id=TicTacToe-v0")
