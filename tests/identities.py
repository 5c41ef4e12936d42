"""Identities every correct set of the 10 gradients keeps, whatever way it was computed: checks of
the float64 reference that (but for dbo = Σ dY) do not reuse its formulas (tests/test_reference.py,
test_properties.py)."""
import numpy

from cupy_xattn import reference
from cupy_xattn.grads import INPUT_NAMES


def assert_gradient_identities(inputs, grads, *, num_heads, scale=None, text_lengths=None, rtol=1e-9):
    """``grads`` (CrossAttentionGrads) of L = <dY, Y> for ``inputs`` (the 11 arrays by name).

    - dbo = Σ dY, and dbv = dbo Wo: each row of P sums to 1, so Σ_keys dV = Σ_queries dO.
    - Σ dX = dbq Wq (dX = dQ Wq, dbq = Σ dQ), Σ dT = dbk Wk + dbv Wv; <dX, X> = <dWq, Wq>,
      <dT, T> = <dWk, Wk> + <dWv, Wv> (X and T enter only through their projections).
    - dbk = 0: each row of dS sums to 0.
    - Y is linear in (Wo, bo): <dWo, Wo> + <dbo, bo> = <dY, Y>; Y − bo in (Wv, bv): <dWv, Wv> +
      <dbv, bv> = <dY, Y − bo>.
    - S is unchanged when Q is scaled by t and K by 1/t: <dWq, Wq> + <dbq, bq> = <dWk, Wk> + <dbk, bk>.
    - Q scaled by t is the softmax scale s times t: <dWq, Wq> + <dbq, bq> = s dL/ds, by a central
      difference of the forward (this one sees dS's size and sign, which the others do not).
    """
    a = {name: numpy.asarray(inputs[name], numpy.float64) for name in INPUT_NAMES}
    g = {name: numpy.asarray(x, numpy.float64) for name, x in grads._asdict().items()}
    scale = reference._resolve_scale(scale, a["video_latents"].shape[-1], num_heads)  # a number: s (1 ± h) below

    def forward(s):
        return reference.forward(*(a[name] for name in INPUT_NAMES[1:]), s, num_heads=num_heads,
                                 text_lengths=text_lengths)

    Y, dY = forward(scale), a["grad_output"]

    def close(got, want, label):
        size = max(numpy.abs(want).max(initial=0.0), 1.0)
        assert numpy.abs(got - want).max(initial=0.0) <= rtol * size, label

    def inner(*pairs):  # Σ <x, y> over the pairs, and the sum of |x||y| that bounds its rounding
        return (sum(float(numpy.vdot(x, y)) for x, y in pairs),
                sum(float(numpy.vdot(numpy.abs(x), numpy.abs(y))) for x, y in pairs))

    query_side = inner((g["grad_query_weight"], a["query_weight"]), (g["grad_query_bias"], a["query_bias"]))
    close(g["grad_output_bias"], dY.sum((0, 1)), "dbo = Σ dY")
    close(g["grad_value_bias"], g["grad_output_bias"] @ a["output_weight"], "dbv = dbo Wo")
    close(g["grad_video_latents"].sum((0, 1)), g["grad_query_bias"] @ a["query_weight"], "Σ dX = dbq Wq")
    close(g["grad_text_embeddings"].sum((0, 1)),
          g["grad_key_bias"] @ a["key_weight"] + g["grad_value_bias"] @ a["value_weight"], "Σ dT = dbk Wk + dbv Wv")
    close(g["grad_key_bias"], numpy.zeros_like(g["grad_key_bias"]), "dbk = 0")
    for (got, got_size), (want, want_size), label in [
            (inner((g["grad_output_weight"], a["output_weight"]), (g["grad_output_bias"], a["output_bias"])),
             inner((dY, Y)), "Y linear in Wo, bo"),
            (inner((g["grad_value_weight"], a["value_weight"]), (g["grad_value_bias"], a["value_bias"])),
             inner((dY, Y - a["output_bias"])), "Y - bo linear in Wv, bv"),
            (query_side, inner((g["grad_key_weight"], a["key_weight"]), (g["grad_key_bias"], a["key_bias"])),
             "S invariant under Q t, K / t"),
            (inner((g["grad_video_latents"], a["video_latents"])), inner((g["grad_query_weight"], a["query_weight"])),
             "<dX, X> = <dWq, Wq>"),
            (inner((g["grad_text_embeddings"], a["text_embeddings"])),
             inner((g["grad_key_weight"], a["key_weight"]), (g["grad_value_weight"], a["value_weight"])),
             "<dT, T> = <dWk, Wk> + <dWv, Wv>")]:
        assert abs(got - want) <= rtol * max(got_size, want_size, 1.0), (label, got, want)
    h = 1e-5
    ds = (numpy.vdot(dY, forward(scale * (1 + h))) - numpy.vdot(dY, forward(scale * (1 - h)))) / (2 * h)
    assert abs(query_side[0] - ds) <= 1e-7 * max(inner((dY, Y))[1], 1.0), ("Q t = s t", query_side[0], ds)
