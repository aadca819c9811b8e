"""rendezvous.py: N processes agree on ranks and exchange addresses through tensord (the
Python form of examples/rendezvous.c): a rank from ADD on a counter, the address in a bin of
that rank, a BARRIER, the whole table with one MGET, a second BARRIER before leaving.

    tensord --port 8000 &
    for i in 0 1 2 3; do python3 rendezvous.py 127.0.0.1:8000 4 job1 & done; wait
"""
import os
import socket
import sys

import tensorshare

TIMEOUT_MS = 30000


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: rendezvous.py HOST:PORT WORLD_SIZE JOB")
    addr, world, job = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with tensorshare.Client(addr) as c:
        rank = c.add(f"{job}/rank") - 1
        if rank >= world:
            sys.exit(f"rank {rank}: more than {world} processes joined")
        c.put(f"{job}/addr/{rank}", f"{socket.gethostname()} pid {os.getpid()}")
        gen = c.barrier(f"{job}/barrier", world, timeout_ms=TIMEOUT_MS)
        table = c.mget([f"{job}/addr/{r}" for r in range(world)], max_items=1)
        missing = [name for name, items in table.items() if not items]
        if missing:
            sys.exit(f"addresses missing after the barrier: {missing}")
        if rank == 0:
            for r in range(world):
                print(f"rank {r}: {table[f'{job}/addr/{r}'][0]}")
        gen2 = c.barrier(f"{job}/barrier", world, timeout_ms=TIMEOUT_MS)
        if rank == 0:
            print(f"rendezvous: {world} processes, barrier generations {gen} and {gen2}")


if __name__ == "__main__":
    main()
