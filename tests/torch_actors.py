"""Actor classes for the torch tests (imported by actor processes by module name)."""

import numpy as np
import torch

import actorshm
import actorshm.torch as at
from actorshm import actor


class Tagged(torch.Tensor):
    """A tensor subclass of one's own, as torchvision's ``tv_tensors.Image`` is."""


class _Failing:
    """A dataset whose every item raises."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise ValueError(f"no item {i}")


@actor
class TorchWorker:
    def echo(self, x):
        return x

    def add_one(self, t):
        t += 1
        return float(t.sum())

    def count_shared(self, ts):
        return sum(at.is_shared(t) for t in ts)

    def write_first_read_second(self, a, b):
        """Write through ``a``; what ``b`` then reads, and whether they share a storage."""
        with torch.no_grad():
            a.view(-1)[0] = 1000
        return float(b.reshape(-1)[0]), \
            a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    def storages(self, ts):
        """How many storages the tensors ``ts`` view."""
        return len({t.untyped_storage().data_ptr() for t in ts})

    def poke_storage(self, st):
        """Set the first byte of storage ``st`` to 7; its kind, bytes and dtype."""
        untyped = st._untyped_storage if isinstance(st, torch.TypedStorage) else st
        torch.empty(0, dtype=torch.uint8).set_(untyped)[0] = 7
        return type(st).__name__, untyped.nbytes(), getattr(st, "dtype", None)

    def fill(self, t, value):
        with torch.no_grad():
            t.fill_(value)

    def info(self, t):
        return {"dtype": t.dtype, "shape": tuple(t.shape), "stride": t.stride(),
                "offset": t.storage_offset(), "parameter": isinstance(t, torch.nn.Parameter),
                "requires_grad": t.requires_grad, "shared": at.is_shared(t),
                "type": type(t).__name__}

    def make(self, n, value, dtype=torch.float32):
        self.kept = at.empty(n, dtype=dtype)
        self.kept.fill_(value)
        return self.kept

    def kept_sum(self):
        return float(self.kept.sum())

    def load_failing(self):
        """Iterate a DataLoader with a worker over items that raise (the method raises,
        and its exception keeps the iterator, and the instance, in a reference cycle).
        Automatic collections stop here first: one while the actor runs would collect
        the cycle then, and the iterator would join its worker for 5 s in the actor's
        loop (as in any program: torch's behaviour), not at the stop this tests."""
        import gc

        from torch.utils.data import DataLoader
        gc.disable()
        return list(DataLoader(_Failing(), batch_size=2, num_workers=1))

    async def send_loader_batches(self, other, rows, batch_size):
        """Send ``other`` the batches of a DataLoader with a worker; what warned."""
        import warnings

        from torch.utils.data import DataLoader, TensorDataset
        data = torch.arange(rows * 2.0).reshape(rows, 2)
        batches = [b for (b,) in DataLoader(TensorDataset(data), batch_size=batch_size,
                                           num_workers=1)]
        copied = actorshm.stats()["bytes_copied"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            back = [await other.echo(b) for b in batches]
        copied = actorshm.stats()["bytes_copied"] - copied
        with warnings.catch_warnings(record=True) as then:
            warnings.simplefilter("always")
            await other.echo(torch.ones(4).share_memory_())
        return {"in_torch_shared_memory": batches[0].untyped_storage().is_shared(),
                "same": torch.equal(torch.cat(back), data), "bytes_copied": copied,
                "warnings": [str(w.message) for w in caught],
                "then": [str(w.message) for w in then]}

    def sgd_step(self, model, lr):
        with torch.no_grad():
            for p in model.parameters():
                p -= lr
        return sum(float(p.sum()) for p in model.parameters())

    def fill_path(self, obj, path, value):
        """Fill the tensor at dotted attribute ``path`` of ``obj`` (e.g. a module's)."""
        for name in path.split("."):
            obj = getattr(obj, name)
        with torch.no_grad():
            obj.fill_(value)

    def fill_numpy(self, a, value):
        a[...] = value

    def threads(self):
        return torch.get_num_threads()

    def stats(self):
        return actorshm.stats()

    def as_numpy_sum(self, a):
        return float(np.asarray(a).sum())
