"""When a run saves (jddp/checkpoint/policy.py): every k steps, by the clock (its flag read one
step late, the same on every process), at eval steps for the best checkpoints."""

from jddp.checkpoint.policy import SAVE_KEY, SavePolicy


class Clock:
    """A clock the test moves: ``now`` seconds."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_loop(policy: SavePolicy, clock: Clock, steps: int, step_s: float) -> list[int]:
    """The steps saved when the loop of jddp/run/loop.py drives ``policy``: each step's flag
    is made before the step runs (``step_s`` seconds), its metrics are read one step late
    (or at once when the step is to be saved), then the step is saved if due."""
    saved, pending = [], None
    for step in range(1, steps + 1):
        flag = bool(policy.flags(1).get(SAVE_KEY, [0.0])[0])
        clock.now += step_s
        if pending is not None:
            policy.heard(*pending)
        pending = (step, flag)
        if policy.due(step):  # its line first
            policy.heard(*pending)
            pending = None
        if policy.due(step):
            policy.saved(step)
            saved.append(step)
    return saved


def test_one_save_per_period_by_the_clock():
    """A period of 0.35 s and steps of 0.1 s: the flag is raised by the first step dispatched
    after the period (step 5, at 0.4 s), read and saved after the next; then the clock starts
    again. Never two saves in a row: the flag of the step dispatched before the save, read
    after it, had asked again (saves at 6/7, 13/14, ...)."""
    clock = Clock()
    policy = SavePolicy(every_steps=0, every_minutes=0.35 / 60, clock=clock)
    saved = run_loop(policy, clock, 30, 0.1)
    assert saved == [6, 12, 18, 24, 30], saved


def test_a_period_shorter_than_a_step_saves_once_per_request():
    """A period shorter than a step: every flag made a period after a save asks; a save
    answers every request raised before it (the flags of the step it saves and of the next,
    dispatched before it ended)."""
    clock = Clock()
    policy = SavePolicy(every_steps=0, every_minutes=0.001 / 60, clock=clock)
    assert run_loop(policy, clock, 9, 0.1) == [3, 6, 9]


def test_every_steps_wins_over_the_clock_and_eval_steps_save_for_the_best():
    clock = Clock()
    policy = SavePolicy(every_steps=3, every_minutes=0.001 / 60, clock=clock)
    assert policy.flags(4) == {}  # the clock is not asked
    assert run_loop(policy, clock, 10, 0.1) == [3, 6, 9]
    best = SavePolicy(every_steps=4, eval_every_steps=3, save_at_evals=True)
    assert [s for s in range(1, 13) if best.due(s)] == [3, 4, 6, 8, 9, 12]
    assert not any(SavePolicy(every_steps=0, eval_every_steps=3).due(s) for s in range(1, 13))


def test_a_flag_read_after_the_save_it_asked_for_asks_nothing():
    """The flag of the saved step itself (and of any step before it), raised before the save
    and read after it, is answered by that save (read so it had saved again at the next
    step)."""
    policy = SavePolicy(every_steps=0, every_minutes=1.0)
    policy.heard(4, True)
    assert policy.due(5)
    policy.saved(5)
    policy.heard(5, True)
    assert not policy.due(6) and not policy.due(7)
    policy.heard(6, True)
    assert policy.due(7)


def test_the_flags_of_steps_before_a_resume_ask_nothing():
    policy = SavePolicy(every_steps=0, every_minutes=1.0, start_step=10)
    policy.heard(10, True)
    assert not policy.due(11)
    policy.heard(11, True)
    assert policy.due(12) and policy.due(11)
