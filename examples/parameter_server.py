"""Parameter server on actorshm: one server actor holds an MLP's weights in shared memory,
N worker actors each own a shard of scikit-learn's digits and push gradients.

    python examples/parameter_server.py                       # sync, 2 workers
    python examples/parameter_server.py --mode async --workers 4
    python examples/parameter_server.py --single              # one process, same settings
    python examples/parameter_server.py --quick               # a few seconds, for tests
    python examples/parameter_server.py --torch               # torch tensors and autograd
    python examples/parameter_server.py --backend ray         # the same actors on Ray
    python examples/parameter_server.py --backend ray --address auto   # on a Ray cluster

The weights live in one flat float64 buffer from ``actorshm.zeros`` in the server.  Every
reply that carries them is a zero-copy view of that buffer; every gradient a worker
pushes is written into a buffer from ``actorshm.empty`` in the worker, which goes back to
that worker's pool (and is reused) once the server drops it.

With ``--torch`` the model is the same, in torch: the server's weights are one flat float64
tensor from ``actorshm.torch.zeros``, each worker computes its gradient with torch's
autograd and writes it into a tensor from ``actorshm.torch.empty``. The tensors travel as
the numpy buffers do: by reference, recycled, nothing copied.

With ``--backend ray`` the same classes run as Ray actors, on one machine or across a
cluster's nodes: weights and gradients then travel through Ray's object store (copied,
read-only on arrival), so the buffers are ordinary numpy arrays there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np

import actorshm
from actorshm import actor

HIDDEN = 64
N_IN, N_OUT = 64, 10
SHAPES = [(N_IN, HIDDEN), (HIDDEN,), (HIDDEN, N_OUT), (N_OUT,)]
N_PARAMS = sum(int(np.prod(s)) for s in SHAPES)

# ---------------------------------------------------------------------- data and model


def load_data(seed: int):
    """Digits, scaled to [0, 1], split 80/20 (stratified, fixed by ``seed``)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float64)
    return train_test_split(X, y, test_size=0.2, random_state=seed, stratify=y)


def shard(X, y, index: int, count: int):
    return X[index::count], y[index::count]


def init_params(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = np.zeros(N_PARAMS)
    W1, _, W2, _ = unflatten(w)
    W1[...] = rng.normal(0, np.sqrt(2.0 / N_IN), W1.shape)
    W2[...] = rng.normal(0, np.sqrt(1.0 / HIDDEN), W2.shape)
    return w


def unflatten(w):
    """Views of the four parameter tensors inside flat vector ``w`` (no copies)."""
    out, pos = [], 0
    for s in SHAPES:
        n = int(np.prod(s))
        out.append(w[pos:pos + n].reshape(s))
        pos += n
    return out


def forward(w, X, xp=np):
    W1, b1, W2, b2 = unflatten(w)
    h = xp.maximum(X @ W1 + b1, 0)
    z = h @ W2 + b2
    z = z - z.max(axis=1, keepdims=True)
    p = xp.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return h, p


def loss_and_grad(w, X, y, out, xp=np):
    """Cross-entropy loss of batch (X, y); writes d loss / d w into flat ``out``."""
    W1, b1, W2, b2 = unflatten(w)
    h, p = forward(w, X, xp)
    n = X.shape[0]
    loss = float(-xp.log(p[xp.arange(n), y] + 1e-12).mean())
    dz = p
    dz[xp.arange(n), y] -= 1
    dz /= n
    gW1, gb1, gW2, gb2 = unflatten(out)
    gW2[...] = h.T @ dz
    gb2[...] = dz.sum(axis=0)
    dh = (dz @ W2.T) * (h > 0)
    gW1[...] = X.T @ dh
    gb1[...] = dh.sum(axis=0)
    return loss


def accuracy(w, X, y) -> float:
    w = as_numpy(w)
    return float((forward(w, X)[1].argmax(axis=1) == y).mean())


def as_numpy(w) -> np.ndarray:
    """``w`` as a numpy array: a CPU torch tensor's view of the same memory."""
    return w if isinstance(w, np.ndarray) else w.detach().cpu().numpy()


def torch_loss_and_grad(w, X, y, out) -> float:
    """``loss_and_grad`` in torch: autograd of the cross-entropy of batch (X, y) at flat
    float64 tensor ``w``, written into flat tensor ``out`` (all torch tensors)."""
    import torch
    import torch.nn.functional as F
    wl = w.detach().requires_grad_(True)  # a leaf viewing w's memory
    W1, b1, W2, b2 = unflatten(wl)
    z = torch.relu(X @ W1 + b1) @ W2 + b2
    loss = F.cross_entropy(z, y)
    (grad,) = torch.autograd.grad(loss, wl)
    out.copy_(grad)
    return float(loss.detach())


def _torch_empty(n: int, shared: bool):
    """A float64 torch vector; from actorshm's shared memory if ``shared``."""
    import torch
    if shared:
        import actorshm.torch
        return actorshm.torch.empty(n, dtype=torch.float64)
    return torch.empty(n, dtype=torch.float64)


# ---------------------------------------------------------------------- actors


@actor
class Server:
    """Holds the weights; ``push_sync`` gathers N gradients per step, ``push_async`` applies each."""

    def __init__(self, n_workers: int, lr: float, seed: int, backend: str = "local",
                 use_torch: bool = False):
        # Shared on the local backend: every reply is a view of this buffer.
        if use_torch:
            import torch
            self.w = _torch_empty(N_PARAMS, backend == "local")
            self.w.copy_(torch.from_numpy(init_params(seed)))
        else:
            self.w = actorshm.zeros(N_PARAMS) if backend == "local" else np.zeros(N_PARAMS)
            self.w[...] = init_params(seed)
        self.n_workers = n_workers
        self.lr = lr
        self.version = 0
        self.waiting: list[tuple[np.ndarray, asyncio.Future]] = []
        self.acc = _torch_empty(N_PARAMS, False) if use_torch else np.zeros(N_PARAMS)
        self.staleness_sum = 0
        self.pushes = 0

    def weights(self):
        return self.w, self.version

    async def push_sync(self, grad):
        """Wait until every worker has pushed for this step, then all get the new weights."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((grad, fut))
        if len(self.waiting) == self.n_workers:
            self.acc[...] = 0
            for g, _ in self.waiting:
                self.acc += g
            self.w -= (self.lr / self.n_workers) * self.acc
            self.version += 1
            done, self.waiting = self.waiting, []
            for _, f in done:
                f.set_result((self.w, self.version))
            del done, g  # drop the gradient views: their buffers flow back to the workers
        return await fut

    def push_async(self, grad, read_version: int):
        """Apply one gradient now; staleness = updates made since the worker read the weights."""
        self.staleness_sum += self.version - read_version
        self.pushes += 1
        self.w -= self.lr * grad
        self.version += 1
        return self.w, self.version

    def staleness(self) -> float:
        return self.staleness_sum / max(self.pushes, 1)

    def stats(self):
        return actorshm.stats()


@actor
class Worker:
    """Owns one shard of the training set; runs its share of each epoch against the server."""

    def __init__(self, index: int, count: int, seed: int, batch_size: int, device: str = "cpu",
                 backend: str = "local", use_torch: bool = False):
        # Ray copies arguments through its object store: a shared buffer would gain nothing.
        self.alloc = actorshm.empty if backend == "local" else np.empty
        Xtr, _, ytr, _ = load_data(seed)
        self.X, self.y = shard(Xtr, ytr, index, count)
        self.torch = None
        if use_torch:
            import torch
            self.torch = torch
            self.alloc = lambda n: _torch_empty(n, backend == "local")  # as actorshm.empty
            self.Xt = torch.from_numpy(self.X).to(device)
            self.yt = torch.from_numpy(self.y).to(device)
        self.rng = np.random.default_rng(seed * 1000 + index)
        self.batch_size = batch_size
        self.order = np.empty(0, dtype=np.int64)
        self.xp = np
        if device == "cuda" and not use_torch:
            import cupy
            self.xp = cupy
            self.Xd, self.yd = cupy.asarray(self.X), cupy.asarray(self.y)

    def _batch(self):
        if len(self.order) < self.batch_size:
            self.order = np.concatenate([self.order, self.rng.permutation(len(self.X))])
        idx, self.order = self.order[:self.batch_size], self.order[self.batch_size:]
        return idx

    def _grad(self, w, idx):
        g = self.alloc(N_PARAMS)  # shared: recycled, comes home once the server drops it
        if self.torch is not None:
            ii = self.torch.from_numpy(idx).to(self.Xt.device)
            wd = w.to(self.Xt.device)  # w itself on the CPU: no copy
            if wd is w:
                return torch_loss_and_grad(w, self.Xt[ii], self.yt[ii], g), g
            gd = self.torch.empty_like(wd)
            loss = torch_loss_and_grad(wd, self.Xt[ii], self.yt[ii], gd)
            g.copy_(gd)
            return loss, g
        if self.xp is np:
            return loss_and_grad(w, self.X[idx], self.y[idx], g), g
        xp = self.xp
        gd = xp.empty(N_PARAMS)
        ii = xp.asarray(idx)
        loss = loss_and_grad(xp.asarray(w), self.Xd[ii], self.yd[ii], gd, xp)
        g[...] = xp.asnumpy(gd)
        return loss, g

    async def run(self, server, steps: int, mode: str):
        w, version = await server.weights()
        losses = []
        for _ in range(steps):
            loss, g = self._grad(w, self._batch())
            losses.append(loss)
            if mode == "sync":
                w, version = await server.push_sync(g)
            else:
                w, version = await server.push_async(g, version)
            del g
        return float(np.mean(losses))

    def stats(self):
        return actorshm.stats()


# ---------------------------------------------------------------------- driver


def parse(argv=None):
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="per worker and step")
    p.add_argument("--quick", action="store_true", help="few epochs, for tests")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--torch", action="store_true",
                   help="weights and gradients as torch tensors, gradients by autograd")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw loss and accuracy per epoch into FILE.png (matplotlib)")
    p.add_argument("--single", action="store_true",
                   help="train in this one process with the same settings")
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="run the actors as local processes (default) or as Ray actors")
    p.add_argument("--address", help="with --backend ray: a Ray cluster to connect to "
                                     "(default: start a local Ray)")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs = min(args.epochs, 6)
    for name in ("workers", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        p.error(f"--plot {args.plot}: its folder does not exist")  # (not after training)
    if args.torch:
        try:
            import torch
        except ImportError:
            raise SystemExit("--torch needs PyTorch: pip install -e '.[torch]'") from None
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("cuda path not available: torch sees no GPU")
    elif args.device == "cuda":
        try:
            import cupy  # noqa: F401
        except ImportError:
            raise SystemExit("cuda path not available: cupy is not installed") from None
    return args


def steps_per_epoch(n_train: int, args) -> int:
    return max(1, n_train // (args.workers * args.batch_size))


def total_stats(dicts):
    keys = ("bytes_copied", "bytes_zero_copy", "pool_allocs", "pool_reuses")
    return {k: sum(d.get(k, 0) for d in dicts) for k in keys}


async def _distributed(args, Xtr, Xte, ytr, yte):
    server = await Server.options(max_concurrency=args.workers + 2).spawn(
        args.workers, args.lr, args.seed, args.backend, args.torch)
    workers = await asyncio.gather(*[
        Worker.spawn(i, args.workers, args.seed, args.batch_size, args.device, args.backend,
                     args.torch)
        for i in range(args.workers)])
    actors = [server, *workers]
    steps = steps_per_epoch(len(Xtr), args)
    history = []
    before = total_stats([actorshm.stats(), *await asyncio.gather(*[a.stats() for a in actors])])
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        losses = await asyncio.gather(*[w.run(server, steps, args.mode) for w in workers])
        dt = time.perf_counter() - t0
        w, _ = await server.weights()
        acc = accuracy(w, Xte, yte)
        del w
        now = total_stats([actorshm.stats(), *await asyncio.gather(*[a.stats() for a in actors])])
        st = {k: now[k] - before[k] for k in now}  # this epoch's counts, all processes
        before = now
        sps = steps * args.workers / dt  # gradient steps (pushes) per second
        history.append(dict(epoch=epoch, loss=float(np.mean(losses)), accuracy=acc,
                            steps_per_s=sps, **st))
        print(f"epoch {epoch:3d}  loss {np.mean(losses):.4f}  acc {acc:.3f}  "
              f"{sps:7.0f} steps/s  copied {st['bytes_copied']} B  "
              f"by reference {st['bytes_zero_copy']} B  "
              f"pool allocs {st['pool_allocs']} reuses {st['pool_reuses']}", flush=True)
    staleness = await server.staleness() if args.mode == "async" else 0.0
    if args.mode == "async":
        print(f"average staleness: {staleness:.2f} updates")
    w, _ = await server.weights()
    final = as_numpy(w).copy()  # our own copy, so the server's buffer can go
    del w
    for a in actors:
        await a.kill()
    return final, history, staleness


def _single(args, Xtr, Xte, ytr, yte):
    """Same model, lr, epochs and steps; one step uses workers*batch_size samples (= sync)."""
    w = init_params(args.seed)
    g = np.empty(N_PARAMS)
    grad_fn = loss_and_grad
    if args.torch:
        import torch
        Xtr, ytr = torch.from_numpy(Xtr), torch.from_numpy(ytr)
        w, g = torch.from_numpy(w), torch.from_numpy(g)  # views: the same memory
        grad_fn = torch_loss_and_grad
    rng = np.random.default_rng(args.seed)
    steps = steps_per_epoch(len(Xtr), args)
    bs = args.workers * args.batch_size
    order = np.empty(0, dtype=np.int64)
    history = []
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        losses = []
        for _ in range(steps):
            if len(order) < bs:
                order = np.concatenate([order, rng.permutation(len(Xtr))])
            idx, order = order[:bs], order[bs:]
            if args.torch:
                idx = torch.from_numpy(idx)
            losses.append(grad_fn(w, Xtr[idx], ytr[idx], g))
            w -= args.lr * g
        dt = time.perf_counter() - t0
        acc = accuracy(w, Xte, yte)
        history.append(dict(epoch=epoch, loss=float(np.mean(losses)), accuracy=acc,
                            steps_per_s=steps / dt))
        print(f"epoch {epoch:3d}  loss {np.mean(losses):.4f}  acc {acc:.3f}  "
              f"{steps / dt:7.0f} steps/s  (single process)", flush=True)
    return as_numpy(w), history, 0.0


def plot(history, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    ep = [h["epoch"] for h in history]
    ax[0].plot(ep, [h["loss"] for h in history])
    ax[0].set(xlabel="epoch", ylabel="train loss")
    ax[1].plot(ep, [h["accuracy"] for h in history])
    ax[1].set(xlabel="epoch", ylabel="test accuracy")
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv=None) -> dict:
    args = parse(argv)
    Xtr, Xte, ytr, yte = load_data(args.seed)
    what = "single process" if args.single else \
        f"{args.mode}, {args.workers} workers, {args.backend} backend"
    if args.torch:
        what += ", torch"
    print(f"parameter server: {what}, {N_PARAMS} params, train {len(Xtr)} test {len(Xte)}")
    t0 = time.perf_counter()
    if args.single:
        w, history, staleness = _single(args, Xtr, Xte, ytr, yte)
    else:
        opts = {"backend": args.backend}
        if args.backend == "ray":
            opts.update(address=args.address, log_to_driver=False)
        w, history, staleness = actorshm.run(_distributed(args, Xtr, Xte, ytr, yte), **opts)
    elapsed = time.perf_counter() - t0
    acc = accuracy(w, Xte, yte)
    if args.plot:
        plot(history, args.plot)
    print(f"time: {elapsed:.1f} s")
    print(f"final test accuracy: {acc:.3f}")
    return {"test_accuracy": acc, "history": history, "staleness": staleness,
            "time_s": elapsed, "steps_per_s": float(np.mean([h["steps_per_s"] for h in history]))}


if __name__ == "__main__":
    main()
