"""Train a small cross-attention layer to imitate another one, with plain SGD, and print the
loss falling: ``CrossAttention.forward`` / ``backward`` in a NumPy or CuPy training loop.

Usage: PYTHONPATH=. python3 scripts/train_tiny.py [--backend numpy|cupy] [--steps 30]
"""
import argparse

import numpy

from cupy_xattn.layer import CrossAttention


def train(backend="numpy", steps=30, lr=0.5, batch=2, video_tokens=16, text_tokens=12, hidden=64, heads=1,
          precision="tf32", log=print):
    """The loss (mean squared error against the teacher's output) before each step."""
    xp = numpy if backend == "numpy" else __import__("cupy")
    rng = numpy.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((batch, video_tokens, hidden), dtype=numpy.float32))
    t = xp.asarray(rng.standard_normal((batch, text_tokens, hidden), dtype=numpy.float32))
    lengths = [text_tokens - 3] + [text_tokens] * (batch - 1)  # the first sample's text is padded
    teacher = CrossAttention(hidden, heads, precision=precision, backend=backend, seed=1)
    student = CrossAttention(hidden, heads, precision=precision, backend=backend, seed=2)
    target = teacher.forward(x, t, lengths)
    losses = []
    for step in range(steps):
        diff = student.forward(x, t, lengths) - target
        losses.append(float((diff ** 2).mean()))
        student.zero_grad()
        student.backward(2 * diff / diff.size)
        for name, param in student.params.items():
            param -= lr * student.grads[name]
        log(f"step {step:3d}  loss {losses[-1]:.6f}")
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()
    losses = train(args.backend, args.steps, args.lr)
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f} in {args.steps} steps")


if __name__ == "__main__":
    main()
