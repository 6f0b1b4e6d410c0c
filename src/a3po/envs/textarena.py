"""`textarena`: a single-player game of the TextArena library as an environment (the `textarena` extra).

The game `train_dataset.env_id` names is made without TextArena's wrappers: its default one
writes the whole game history into every observation, which the episode's chat already holds.
So the first prompt is the game's opening messages, each later user message is what the game
said since the model's last move (its echo of that move left out), and the model's reply goes
to the game as it is. TextArena games reward only at the end: the episode's reward is what
the game gives player 0 then (1 for a win; a loss 0, -1 or partial credit, as the game defines).

Each example seeds its game with a hash of its question and answer, and each move reseeds
Python's `random` (which TextArena's games draw from, 2048's new tiles for one) from that seed
and the move's number: an episode is the same given its example and the model's moves, however
the episodes sharing its process interleave, so a3po can rebuild it by replaying them (host.py).
The library is imported only when a game is asked for.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

from a3po.config.choices import TEXTARENA
from a3po.config.extras import missing_line
from a3po.config.load import suggest
from a3po.data import DataError
from a3po.envs.base import Step

PLAYER = 0  # the model is TextArena's player 0, the one player of a single-player game
EXAMPLE_GAME = "GuessTheNumber-v0"


def _registry() -> dict[str, Any]:
    try:
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError:
        raise DataError(missing_line("textarena", f"train_dataset.env={TEXTARENA}")) from None
    return ENV_REGISTRY


def make_game(game_id: str):
    """The TextArena game `game_id`, unwrapped (see the module's docstring)."""
    import textarena

    game = textarena.make(game_id)
    while isinstance(game, textarena.Wrapper):
        game = game.env
    return game


def check_game(game_id: str | None) -> None:
    """A DataError unless `game_id` is a TextArena game that one player can start, found before any worker starts."""
    games = _registry()
    if game_id not in games:
        raise DataError(f"train_dataset.env_id={game_id!r} is not a TextArena game{suggest(str(game_id), games)}; "
                        f"name one of textarena.envs.registration.ENV_REGISTRY, e.g. {EXAMPLE_GAME}")
    state = random.getstate()  # TextArena seeds Python's global generator; this process's must not change
    try:
        make_game(game_id).reset(num_players=1, seed=0)
    except Exception as e:
        raise DataError(f"train_dataset.env_id={game_id!r} did not start as a one-player game "
                        f"({type(e).__name__}: {str(e)[:120]}); a3po plays TextArena's single-player games, "
                        f"e.g. {EXAMPLE_GAME}") from None
    finally:
        random.setstate(state)


def game_seed(example) -> int:
    return zlib.crc32(f"{example.question}\n{example.answer}".encode())


class TextArenaEnv:
    stop = ()
    discount = 1.0  # the reward comes once, at the end

    @staticmethod
    def warm_up() -> None:
        import textarena  # noqa: F401 - loaded before the environment process says it is ready

    def __init__(self, example, game_id: str):
        self.game = make_game(game_id)
        self.seed = game_seed(example)
        self.moves = 0

    def reset(self) -> str:
        self.game.reset(num_players=1, seed=self.seed)
        return self._news()

    def step(self, action: str) -> Step:
        self.moves += 1
        random.seed(f"{self.seed}/{self.moves}")
        done, _ = self.game.step(action)
        if done:
            rewards, _ = self.game.close()
            return Step(reward=float((rewards or {}).get(PLAYER, 0.0)), done=True)
        return Step(self._news())

    def _news(self) -> str:
        """The game's messages to the model since its last move, without the echo of that move."""
        _, messages = self.game.get_observation()
        return "\n".join(text.strip() for sender, text, _ in messages if sender != PLAYER and text.strip())
