"""Busy for BUSY s, asleep for IDLE s, for DURATION s: python cpu_hog.py BUSY IDLE DURATION"""
import sys
import time

busy, idle = float(sys.argv[1]), float(sys.argv[2])
end = time.time() + float(sys.argv[3])
while time.time() < end:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(idle)
