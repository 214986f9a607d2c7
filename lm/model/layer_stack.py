"""How the stacked layers run (`lm.model.transformer`'s, whole or as a pipeline chunk): one
`lax.scan` per run of equal layers, fp8-skipped layers as separate segments, or one scan over a
repeating period of dense and sparse layers (`layer_segments` says which).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lm.model import lora
from lm.model.config import ModelConfig, shortest_period
from lm.model.fp8 import fp8_suspended
from lm.model.precision import Policy
from lm.model.split_backward import layer_taps, stack_taps
from sharding.remat import remat


@dataclasses.dataclass(frozen=True)
class StackRunner:
    """Applies stacked layers' states to the residual stream as `cfg` (remat, scan) and `policy`
    (fp8 and its skipped layers) say."""

    cfg: ModelConfig
    policy: Policy

    def run_periods(self, period: tuple[str, ...], stacks: dict, x, positions_bt, cache, cache_index, segments_bt, in_fp8: bool):
        """The layers of `stacks` (kind -> (graphdef, its states: a tuple)) as repeats of `period`
        (their kinds in order): the whole model, or a pipeline chunk; one `lax.scan` over the
        repeats (`model.moe_layers='every:N'`): each repeat takes its dense and its sparse layers
        from the two stacks in turn."""
        repeats = jax.tree.leaves(stacks[period[0]][1])[0].shape[0] // period.count(period[0])

        def per_repeat(tree, width):  # [repeats * width, ...] -> [repeats, width, ...]
            return jax.tree.map(lambda a: a.reshape(repeats, width, *a.shape[1:]), tree)

        params = {kind: per_repeat(states, period.count(kind)) for kind, (_, states) in stacks.items()}
        caches = None if cache is None else per_repeat(cache, len(period))

        def applied(graphdef):
            def layer(x, states, layer_cache, layer_id):
                with lora.in_layer(layer_id):
                    return nnx.merge(graphdef, *states)(x, positions_bt, layer_cache, cache_index, segments_bt)

            return remat(layer, self.cfg.remat, prevent_cse=not self.cfg.scan_layers)

        layers = {kind: applied(graphdef) for kind, (graphdef, _) in stacks.items()}

        def one_repeat(x, params_caches):
            params, caches, repeat = params_caches
            taken, out = dict.fromkeys(params, 0), []
            for j, kind in enumerate(period):
                layer_params = jax.tree.map(lambda a: a[taken[kind]], params[kind])  # noqa: B023
                taken[kind] += 1
                layer_cache = None if caches is None else jax.tree.map(lambda a: a[j], caches)  # noqa: B023
                x, layer_cache = layers[kind](x, layer_params, layer_cache, None if repeat is None else repeat * len(period) + j)
                out.append(layer_cache)
            return x, None if caches is None else jax.tree.map(lambda *a: jnp.stack(a), *out)

        with fp8_suspended(self.policy.fp8 is not None and not in_fp8):
            if self.cfg.scan_layers:
                x, new = jax.lax.scan(one_repeat, x, (params, caches, jnp.arange(repeats) if lora.dropping() else None))
            else:
                new = []
                for r in range(repeats):
                    x, repeat_cache = one_repeat(x, (*jax.tree.map(lambda a: a[r], (params, caches)), r))  # noqa: B023
                    new.append(repeat_cache)
                new = None if cache is None else jax.tree.map(lambda *a: jnp.stack(a), *new)
        return x, None if cache is None else jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), new)

    def run_stack(self, graphdef, stacked: tuple, x, positions_bt, cache, cache_index, segments_bt=None, chunk=None, first=0):
        """The stacked layers (all of them, the model's layers `first` .., or pipeline chunk
        `chunk`, a traced index: layers first + chunk * n .. of the model's; `stacked`: their states)
        applied in order; layers that `precision.fp8_skip` keeps out of fp8 run as separate
        segments."""

        def layer(x, params_cache_taps_id):
            params, layer_cache, taps, layer_id = params_cache_taps_id
            with layer_taps(taps), lora.in_layer(layer_id):  # a split backward's taps (`lm.model.split_backward`) or None
                return nnx.merge(graphdef, *[p for p in params if p is not None])(x, positions_bt, layer_cache, cache_index, segments_bt)

        def run(x, segment, in_fp8: bool):
            # A new function each call: jax caches a scan body's trace (and a remat's) by the function
            # and its input types, and whether fp8 is suspended is neither: segments of equal length in
            # and out of fp8, or `either`'s two branches, would share the first one's trace. Remat also
            # inside a pipeline tick: one layer's internals at a time.
            body = remat(functools.partial(layer), self.cfg.remat, prevent_cse=not self.cfg.scan_layers)
            with fp8_suspended(self.policy.fp8 is not None and not in_fp8):
                if self.cfg.scan_layers:
                    return jax.lax.scan(body, x, segment)
                caches = []
                for i in range(jax.tree.leaves(segment)[0].shape[0]):
                    x, layer_cache = body(x, jax.tree.map(lambda a: a[i], segment))
                    caches.append(jax.tree.map(lambda a: a[None], layer_cache))
                return x, jax.tree.map(lambda *a: jnp.concatenate(a), *caches)

        def either(x, segment, in_fp8):  # fp8 or not as the chunk's layer is: chosen at run time
            # Under the vmap over stages both branches run; jax masks each one's gradients (and
            # so the statistics probes') to the stages that took it.
            return jax.lax.cond(in_fp8, lambda x: run(x, segment, True)[0], lambda x: run(x, segment, False)[0], x), None

        num_layers = jax.tree.leaves(stacked)[0].shape[0]
        in_fp8 = self.fp8_positions(num_layers, chunk, first)
        runs, new_caches = _runs(in_fp8), []
        for start, stop in runs:
            segment = (stacked, cache) if len(runs) == 1 else jax.tree.map(lambda a: a[start:stop], (stacked, cache))
            # Each layer's index in the model, where LoRA dropout needs it (its masks differ by layer).
            segment = (*segment, stack_taps(stop - start), first + jnp.arange(start, stop) if lora.dropping() else None)
            x, segment_cache = (run if isinstance(in_fp8[start], bool) else either)(x, segment, in_fp8[start])
            new_caches.append(segment_cache)
        if cache is None:
            return x, None
        return x, jax.tree.map(lambda *a: jnp.concatenate(a), *new_caches)

    def fp8_positions(self, size: int, chunk, first: int = 0) -> list:
        """Per layer of a stack of `size` (from the model's layer `first`): in fp8 (True / False),
        or, in a pipeline chunk whose layer at that position is skipped in some chunks only, a
        traced bool (`fp8_skip` indices are the model's layer indices, whatever the schedule)."""
        mask = self.policy.fp8_layer_mask(self.cfg.num_layers)
        mask = mask[first : first + size] if chunk is None else mask[first:]  # a pipeline's chunks: of the layers from `first`
        columns = [[mask[c * size + j] for c in range(len(mask) // size)] for j in range(size)]
        return [column[0] if len(set(column)) == 1 else jnp.asarray(column)[chunk] for column in columns]


def layer_segments(kinds: list[str], periodic: bool = True) -> list[tuple[int, int, tuple[str, ...]]]:
    """The model's layers (each's kind: its stack, as 'dense' / 'sparse') as segments to run in order:
    (start, stop, period). A period of one kind: a run of equal layers, one scan; a longer period
    (`periodic`, where the kinds alternate in more than two runs and repeat whole): the whole
    model as one scan over its repeats. ['d', 'd', 's', 's'] -> two runs; ['d', 's'] x 24 -> one
    scan over 24 repeats of ('d', 's')."""
    n = len(kinds)
    runs = [0] + [i for i in range(1, n) if kinds[i] != kinds[i - 1]] + [n]
    if periodic and len(runs) > 3 and (p := shortest_period(kinds)) <= n // 2:
        return [(0, n, tuple(kinds[:p]))]
    return [(a, b, (kinds[a],)) for a, b in zip(runs[:-1], runs[1:])]


def _runs(flags: list) -> list[tuple[int, int]]:
    """[start, stop) ranges of equal consecutive flags, each traced flag alone: [T, T, F, T] ->
    [(0, 2), (2, 3), (3, 4)]."""
    alone = lambda f: not isinstance(f, bool)  # noqa: E731
    bounds = [0] + [i for i in range(1, len(flags)) if alone(flags[i]) or alone(flags[i - 1]) or flags[i] != flags[i - 1]] + [len(flags)]
    return list(zip(bounds[:-1], bounds[1:]))
