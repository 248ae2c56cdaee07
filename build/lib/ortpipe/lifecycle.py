"""The lifecycle of a token sequence being generated (a request, or a chat across its turns).

The rules are data: TRANSITIONS says which event moves a sequence from each state to which, and
nothing else may happen. An event that a state does not allow is a GenerationError saying why, in
the words of REFUSALS.

    IDLE --append--> READY --begin--> STEPPING --end-----> READY  (a step gave tokens; more may follow)
                                          |------finish--> DONE   (eos, the length limit, an interrupt)
                                          '------fail----> ERROR  (the target raised, or Ctrl-C, mid-step)
    READY --stop--> DONE                                           (interrupted between steps, or no room)
    DONE --append--> READY                                         (continue: a chat's next turn)
    IDLE, READY, DONE, ERROR --rewind--> READY --empty--> IDLE  (when the rewind left nothing to run)
    IDLE, READY, DONE --resample--> the same state              (new sampling settings between requests)

A step that fails leaves the KV cache in a state nobody can vouch for after the last complete
step; rewinding to a length before the failed step makes the sequence whole again (every
position before it was written by complete steps).
"""

from __future__ import annotations

from .errors import GenerationError

IDLE, READY, STEPPING, DONE, ERROR = "idle", "ready", "stepping", "done", "error"
APPEND, BEGIN, END, FINISH, STOP, FAIL, REWIND, EMPTY, RESAMPLE = (
    "append", "begin", "end", "finish", "stop", "fail", "rewind", "empty", "resample")

TRANSITIONS: dict[tuple[str, str], str] = {
    (IDLE, APPEND): READY,
    (READY, APPEND): READY,
    (DONE, APPEND): READY,
    (READY, BEGIN): STEPPING,
    (STEPPING, END): READY,
    (STEPPING, FINISH): DONE,
    (STEPPING, FAIL): ERROR,
    **{(state, REWIND): READY for state in (IDLE, READY, DONE, ERROR)},
    (READY, EMPTY): IDLE,  # a rewind left nothing to run
    (READY, STOP): DONE,  # interrupted between steps, or the ids appended fill max_length
    **{(state, RESAMPLE): state for state in (IDLE, READY, DONE)},
}

REFUSALS: dict[tuple[str, str], str] = {
    (IDLE, BEGIN): "append tokens (a prompt) before asking for the next token",
    (DONE, BEGIN): "generation is done (eos, max_length or interrupt); append tokens to go on",
    (
        ERROR,
        BEGIN,
    ): "an earlier step of this generation failed ({cause}); its cache cannot be trusted: start a "
    "new request, or rewind a chat to its last complete turn",
    (ERROR, APPEND): "an earlier step of this generation failed ({cause}); rewind before appending",
    (STEPPING, BEGIN): "a step of this generation is already running: one step at a time",
    (STEPPING, APPEND): "a step of this generation is running: append after it ends",
    (STEPPING, REWIND): "a step of this generation is running: rewind after it ends",
    (STEPPING, RESAMPLE): "a step of this generation is running: change its settings after it ends",
    (ERROR, RESAMPLE): "an earlier step of this generation failed ({cause}); rewind before resampling",
}


class Lifecycle:
    """One sequence's state; `fire` moves it by TRANSITIONS or refuses with REFUSALS."""

    __slots__ = ("state", "cause")

    def __init__(self) -> None:
        self.state = IDLE
        self.cause = ""  # what put the sequence in ERROR

    def fire(self, event: str) -> None:
        after = TRANSITIONS.get((self.state, event))
        if after is None:
            why = REFUSALS.get(
                (self.state, event), f"{event} is not allowed while the generation is {self.state}"
            )
            raise GenerationError(why.format(cause=self.cause))
        self.state = after

    def fail(self, error: BaseException) -> None:
        """A step raised: the sequence is in ERROR until rewound."""
        self.cause = f"{type(error).__name__}: {error}"[:300] if str(error) else type(error).__name__
        self.state = TRANSITIONS[(STEPPING, FAIL)]
