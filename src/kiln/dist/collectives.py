"""All-reduce written out over point-to-point messages (`batch_isend_irecv`): ring and recursive doubling.

Ring (bandwidth-optimal, what NCCL uses for large messages): the flat tensor is cut into p chunks
(any size: `tensor_split` gives chunks of n // p or n // p + 1 elements, empty ones when n < p).
Reduce-scatter: in p - 1 rounds each rank sends one chunk to the next rank and adds the chunk it
receives from the previous one, so rank r ends owning the full sum of chunk (r + 1) mod p.
All-gather: p - 1 more rounds pass the finished chunks around. Each rank sends 2 (p - 1) / p * n
elements in 2 (p - 1) messages: T = 2 (p - 1) alpha + 2 (p - 1) / p * n / beta.

Recursive doubling (latency-optimal, for small messages): in log2 p rounds rank r exchanges its whole
partial sum with r XOR 2^k and adds: T = log2(p) (alpha + n / beta). A world that is not a power of
two folds first: the ranks past the largest power of two q send their tensors to rank - q, which add
them in; the q ranks run the rounds; the result goes back.

Both take any world size and tensor size and leave the sum in `tensor` in place on every rank, as
`torch.distributed.all_reduce(tensor)` does. The summation order differs from the library's, so
floating-point results agree to rounding, integers exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _exchange(send: torch.Tensor | None, to: int, recv: torch.Tensor | None, frm: int, group) -> None:
    """One round: post the send and the receive together (no deadlock whatever the order), wait."""
    ops = []
    if send is not None and send.numel():
        ops.append(dist.P2POp(dist.isend, send, dist.get_global_rank(group, to) if group else to, group))
    if recv is not None and recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, frm) if group else frm, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` over the group in place, by reduce-scatter then all-gather around a ring."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    if p == 1:
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = list(flat.tensor_split(p))  # views: uneven sizes and empty chunks are fine
    nxt, prv = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):  # reduce-scatter
        send_i, recv_i = (r - s) % p, (r - s - 1) % p
        buf = torch.empty_like(chunks[recv_i])
        _exchange(chunks[send_i], nxt, buf, prv, group)
        chunks[recv_i].add_(buf)
    for s in range(p - 1):  # all-gather: rank r owns chunk (r + 1) % p
        send_i, recv_i = (r + 1 - s) % p, (r - s) % p
        _exchange(chunks[send_i], nxt, chunks[recv_i], prv, group)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def recursive_doubling_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` over the group in place in log2(p) exchange rounds (any p: extra ranks fold in)."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    if p == 1:
        return tensor
    q = 1 << (p.bit_length() - 1)  # the largest power of two <= p
    buf = torch.empty_like(tensor)
    if r >= q:  # fold: hand the tensor to r - q, get the result back at the end
        _exchange(tensor.contiguous(), r - q, None, 0, group)
        _exchange(None, 0, buf, r - q, group)
        tensor.copy_(buf)
        return tensor
    if r + q < p:
        _exchange(None, 0, buf, r + q, group)
        tensor.add_(buf)
    step = 1
    while step < q:
        peer = r ^ step
        _exchange(tensor.contiguous(), peer, buf, peer, group)
        # the same order on both sides of a pair (lower rank's partial first), so every rank ends
        # with bit-identical sums
        if r < peer:
            tensor.add_(buf)
        else:
            tensor.copy_(buf.add_(tensor))
        step <<= 1
    if r + q < p:
        _exchange(tensor.contiguous(), r + q, None, 0, group)
    return tensor
