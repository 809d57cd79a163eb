"""Reading collectives and their bytes off HLO text (noloco_jax.hlo), forms the CPU does not emit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from noloco_jax import hlo
from noloco_jax.trainer import aot

_OPS = ", channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true"
# GPU-style asynchronous and combined collectives, written by hand (no GPU here).
ASYNC = f"""HloModule m

ENTRY %main (p: f32[1000], q: bf16[1000]) -> f32[8000] {{
  %ags = (f32[1000]{{0}}, f32[8000]{{0}}) all-gather-start(f32[1000]{{0}} %p){_OPS}, dimensions={{0}}
  %agd = f32[8000]{{0}} all-gather-done((f32[1000]{{0}}, f32[8000]{{0}}) %ags)
  %ag2 = ((f32[1000]{{0}}, bf16[1000]{{0}}), (f32[8000]{{0}}, bf16[8000]{{0}})) all-gather-start(f32[1000]{{0}} %p, bf16[1000]{{0}} %q){_OPS}, dimensions={{0}}
  %ars = (f32[1000]{{0}}, bf16[1000]{{0}}) all-reduce-start(f32[1000]{{0}} %p, bf16[1000]{{0}} %q){_OPS}, to_apply=%add
  %cps = (f32[1000]{{0}}, f32[1000]{{0}}, u32[]{{:S(2)}}, u32[]{{:S(2)}}) collective-permute-start(f32[1000]{{0}} %p), channel_id=4, source_target_pairs={{{{0,1}},{{1,0}}}}
  %cpd = f32[1000]{{0}} collective-permute-done(%cps)
  %ag = f32[8000]{{0}} all-gather(f32[1000]{{0}} %p){_OPS}, dimensions={{0}}
  %dyn = f32[<=1000]{{0}} collective-permute(f32[<=1000]{{0}} %p), channel_id=6, source_target_pairs={{{{0,1}}}}
  %f8 = f8e4m3fn[1000]{{0}} collective-permute(f8e4m3fn[1000]{{0}} %r), channel_id=7, source_target_pairs={{{{0,1}}}}
  %s4 = s4[1000]{{0}} collective-permute(s4[1000]{{0}} %r), channel_id=8, source_target_pairs={{{{0,1}}}}
  ROOT %rag = f32[1000]{{0}} ragged-all-to-all(%p), replica_groups={{{{0,1}}}}
}}
"""


def test_async_combined_and_narrow_collectives_count_as_their_synchronous_forms():
    """An async gather counted its operand (8x less than the sync form), a combined one only
    its first operand; f8, s4 and dynamic shapes counted 0; ragged-all-to-all was not seen."""
    got = [(op.kind, op.bytes) for op in hlo.collective_ops(ASYNC)]
    assert got == [("all-gather", 32000), ("all-gather", 48000), ("all-reduce", 6000),
                   ("collective-permute", 4000), ("all-gather", 32000),
                   ("collective-permute", 4000), ("collective-permute", 1000),
                   ("collective-permute", 500), ("ragged-all-to-all", 4000)]  # fmt: skip


@pytest.mark.parametrize("dtype", [jnp.int2, jnp.uint2])
def test_two_bit_collectives_count_two_bits_a_value(dtype):
    """XLA keeps int2 / uint2 as s2 / u2 in a collective (s4 is widened to s8 on the CPU):
    collective_ops raised "element type 's2' has no known width"."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("r",))
    swap = jax.shard_map(lambda x: jax.lax.ppermute(x, "r", [(0, 1), (1, 0)]), mesh=mesh,
                         in_specs=P("r"), out_specs=P("r"))
    text = jax.jit(swap).lower(jnp.zeros((2, 1024), dtype)).compile().as_text()
    got = [(op.kind, op.bytes) for op in hlo.collective_ops(text)]
    assert got == [("collective-permute", 1024 * 2 // 8)]


def test_an_unknown_element_type_is_an_error_not_zero_bytes():
    line = "  %x = q9[10]{0} collective-permute(q9[10]{0} %p), source_target_pairs={{0,1}}\n"
    with pytest.raises(ValueError, match="element type 'q9'"):
        hlo.collective_ops("ENTRY %main () -> q9[10] {\n" + line + "}\n")


def test_crossing_bytes_use_the_hlo_device_numbers_of_a_reordered_mesh():
    """The HLO numbers devices by their place in the mesh; the map was keyed by device id."""
    devices = np.array(jax.devices()[:8])[[0, 4, 1, 5, 2, 6, 3, 7]].reshape(2, 4)
    mesh = Mesh(devices, ("replica", "inner"))
    within = [(i, (i + 1) % 4) for i in range(4)]  # a permute inside each replica
    spec = P(("replica", "inner"))
    f = jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, "inner", within), mesh=mesh,
                              in_specs=spec, out_specs=spec))  # fmt: skip
    compiled = f.lower(jax.device_put(jnp.ones(8000), NamedSharding(mesh, spec))).compile()
    ops = hlo.collective_ops(compiled.as_text())
    assert [op.kind for op in ops] == ["collective-permute"]
    assert hlo.crossing_bytes(ops, aot.device_replicas(compiled)) == {}


def test_async_all_to_all_and_combined_permute_count_as_their_synchronous_forms():
    """An async all-to-all counted operand and output (2x, plus its contexts), a combined
    permute-start only its first operand, a scatter-start with a context that context too."""
    text = f"""ENTRY %main (p: f32[1000], q: f32[500]) -> f32[500] {{
  %a = ((f32[1000]{{0}}), f32[1000]{{0}}) all-to-all-start(f32[1000]{{0}} %p){_OPS}, dimensions={{0}}
  %b = ((f32[1000]{{0}}), f32[1000]{{0}}, u32[], u32[]) all-to-all-start(f32[1000]{{0}} %p){_OPS}, dimensions={{0}}
  %c = ((f32[1000]{{0}}, f32[500]{{0}}), (f32[1000]{{0}}, f32[500]{{0}})) collective-permute-start(f32[1000]{{0}} %p, f32[500]{{0}} %q), source_target_pairs={{{{0,1}},{{1,0}}}}
  ROOT %d = ((f32[1000]{{0}}), f32[500]{{0}}, u32[]) reduce-scatter-start(f32[1000]{{0}} %p){_OPS}, dimensions={{0}}
}}
"""
    got = [(op.kind, op.bytes) for op in hlo.collective_ops(text)]
    assert got == [("all-to-all", 4000), ("all-to-all", 4000), ("collective-permute", 6000),
                   ("reduce-scatter", 2000)]  # fmt: skip


def test_collectives_of_an_unsugared_async_wrapper_count_where_it_runs():
    """XLA prints a wrapper of several collectives (a collectives group) as ``async-start(...),
    calls=%group``: its collectives counted in %group, so a switch branch's bytes were split
    over its groups and an entry's collectives were not ``in_entry``."""
    cps = ("  %{0} = (f32[{1}]{{0}}, f32[{1}]{{0}}, u32[], u32[]) collective-permute-start("
           "f32[{1}]{{0}} %p), source_target_pairs={{{{0,1}},{{1,0}}}}\n"
           "  %{0}.d = f32[{1}]{{0}} collective-permute-done(%{0})\n")
    start = "  %s{0} = ((f32[{1}]{{0}}), f32[{1}]{{0}}) async-start(f32[{1}]{{0}} %x), calls=%g{0}\n"
    text = ""
    for g, n in ((1, 1000), (2, 500)):  # two groups of two permutes
        text += (f"%g{g} (p: f32[{n}]) -> f32[{n}] {{\n  %p = f32[{n}]{{0}} parameter(0)\n"
                 + cps.format(f"a{g}", n) + cps.format(f"b{g}", n) + f"  ROOT %r = tuple(%b{g}.d)\n}}\n\n")
    text += ("%branch (x: f32[1000]) -> f32[1000] {\n" + start.format(1, 1000)
             + start.format(2, 500) + "  ROOT %d = f32[1000]{0} async-done(%s1)\n}\n\n")
    assert hlo.bytes_by_computation(text, "collective-permute") == {"branch": 12000}
    entry = text.replace("%branch (", "ENTRY %main (")
    assert [(op.computation, op.in_entry) for op in hlo.collective_ops(entry)] == [("main", True)] * 4
