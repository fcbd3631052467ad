"""Property: under a JSON schema, the output is valid against it — for every schema of a sample
drawn by hypothesis (objects, arrays, enums, constants, strings, integers, numbers, booleans,
nulls, `anyOf`, nested two levels deep, optional properties), checked with `jsonschema`.

On the tiny random model sampling at temperature 1 with a drawn seed: its weights know no JSON,
so each valid answer is the grammar's doing. Sizes are bounded (`maxLength`, `maxItems`,
integer ranges) so that every generation ends within its token budget; an answer cut at
`max_tokens` fails the test.

Hypothesis runs synchronously; the engine lives in its own Trio run on a helper thread for the
whole module (opening one per example would cost most of the time).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trio_mlx
from trio_mlx.structured import OutputFormat

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
WORDS = st.text(alphabet="abcdefgh XYZ-é", min_size=1, max_size=6)


def leaves() -> st.SearchStrategy[dict[str, Any]]:
    strings = st.builds(
        lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
        st.integers(0, 3),
        st.integers(0, 8),
    )
    integers = st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 5000),
    )
    numbers = st.builds(
        lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(1, 100),
    )
    enums = st.lists(st.one_of(WORDS, st.integers(-99, 99)), min_size=1, max_size=4, unique=True)
    return st.one_of(
        strings,
        integers,
        numbers,
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        enums.map(lambda values: {"enum": values}),
        st.one_of(WORDS, st.integers(0, 9), st.booleans()).map(lambda v: {"const": v}),
    )


def schemas() -> st.SearchStrategy[dict[str, Any]]:
    def objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
        return st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda required: {
                    "type": "object",
                    "properties": props,
                    "required": required,
                    "additionalProperties": False,
                }
            )
        )

    def arrays(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
        return st.builds(
            lambda items, lo, extra: {
                "type": "array",
                "items": items,
                "minItems": lo,
                "maxItems": lo + extra,
            },
            children,
            st.integers(0, 1),
            st.integers(0, 2),
        )

    def extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
        any_of = st.lists(children, min_size=2, max_size=3).map(lambda alts: {"anyOf": alts})
        return st.one_of(objects(children), arrays(children), any_of)

    return st.one_of(leaves(), objects(st.recursive(leaves(), extend, max_leaves=4)))


class EngineThread:
    """An engine in its own Trio run on a helper thread; `call` runs a coroutine there."""

    def __init__(self, model: Path, **options: Any) -> None:
        self._ready = threading.Event()
        self.engine: trio_mlx.Engine | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(model, options), daemon=True)
        self._thread.start()
        if not self._ready.wait(120):
            raise RuntimeError("the engine did not start")
        if self._error is not None:
            raise self._error

    def _main(self, model: Path, options: dict[str, Any]) -> None:
        async def run() -> None:
            async with trio_mlx.open_engine(model, **options) as engine:
                self.engine, self.token = engine, trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                self._ready.set()
                await self._stop.wait()

        try:
            trio.run(run)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        async def bounded() -> Any:
            with trio.fail_after(120):
                return await fn(*args, **kwargs)

        return trio.from_thread.run(bounded, trio_token=self.token)

    def close(self) -> None:
        if self._stop is not None and self.token is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(60)


@pytest.fixture(scope="module", params=[1, 4], ids=["serialized", "batched"])
def engine_thread(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[EngineThread]:
    running = EngineThread(tiny_model_dir, max_num_seqs=request.param)
    try:
        yield running
    finally:
        running.close()


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=schemas(), seed=st.integers(0, 2**31))
def test_output_is_valid_against_every_sampled_schema(
    engine_thread: EngineThread, schema: dict[str, Any], seed: int
) -> None:
    engine = engine_thread.engine
    assert engine is not None
    out = engine_thread.call(
        partial(
            engine.chat,
            [{"role": "user", "content": "Answer in JSON."}],
            max_tokens=600,
            temperature=1.0,
            seed=seed,
            output_format=OutputFormat.json_schema(schema),
        )
    )
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    jsonschema.validate(json.loads(out.text), schema)
