import asyncio
import random
import threading

from expstore_rl.envs import Calculator, ReverseDigits
from expstore_rl.envs.pool import EnvPool, EpisodeError, call_env
from expstore_rl.tokenizer import CharTokenizer


def test_reverse_digits_tasks_are_seeded_and_scored():
    env = ReverseDigits()
    tasks = [env.sample_task(random.Random(7)) for _ in range(2)]
    assert tasks[0] == tasks[1] and len(tasks[0]["digits"]) == 3
    task = {"prompt_id": "reverse-123", "digits": "123", "answer": "321"}
    assert env.reset(task) == "123="
    assert env.step("321<eos>") == ("", 1.0, True)
    assert env.step("322<eos>")[1] == 0.0 and env.step("3215")[1] == 0.0
    assert env.solution(task) == "321<eos>"


def test_calculator_needs_the_product_and_its_solution_uses_the_tool():
    env = Calculator()
    task = env.sample_task(random.Random(0))
    a, b = map(int, task["expr"].split("*"))
    assert 10 <= a <= 99 and 10 <= b <= 99 and task["answer"] == str(a * b)
    env.reset(task)
    assert env.step(f"{a * b}<eos>")[1] == 1.0 and env.step(f"{a * b + 1}<eos>")[1] == 0.0
    assert env.tools == ("calc",)
    CharTokenizer().encode(env.solution(task))  # encodable by the toy tokenizer


def test_pool_runs_many_at_once_up_to_its_concurrency():
    state = {"now": 0, "max": 0}

    async def job():
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        await asyncio.sleep(0)
        state["now"] -= 1
        return 1

    async def main():
        return [r async for r in EnvPool(concurrency=200).run(job for _ in range(500))]

    assert asyncio.run(main()) == [1] * 500
    assert state["max"] == 200


def test_pool_goes_on_after_a_crash_and_a_timeout():
    release = asyncio.Event

    async def main():
        hang = release()

        async def ok():
            return "ok"

        async def crash():
            raise RuntimeError("env exploded")

        async def stuck():
            await hang.wait()

        results = [r async for r in EnvPool(concurrency=2, timeout=0.2).run([crash, stuck, ok, ok])]
        return results

    results = asyncio.run(main())
    errors = sorted(r.reason for r in results if isinstance(r, EpisodeError))
    assert errors == ["env_crash", "timeout"] and results.count("ok") == 2


def test_call_env_names_what_went_wrong():
    gate = threading.Event()

    def boom(_):
        raise ValueError("bad")

    async def main():
        try:
            return (await call_env(lambda x: x * 2, 21, timeout=5), await call_env(boom, 1, timeout=5),
                    await call_env(gate.wait, timeout=0.1), await call_env(str, 1, timeout=0))
        finally:
            gate.set()  # asyncio.run joins the abandoned thread at exit

    assert asyncio.run(main()) == ((42, None), (None, "env_crash"), (None, "timeout"), (None, "timeout"))
