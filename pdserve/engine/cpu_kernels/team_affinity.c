/* Where the calling thread's OpenMP team runs: the caller (the team's thread 0, which runs a
 * step's serial parts and its Python) on one core, the team's other threads on the others.
 *
 * Why in C: the team's threads are libgomp's, started by the calling thread at its first
 * parallel region and reused, thread i of every later region being the same pool thread,
 * by every region it opens with no more threads (pdserve's kernels and torch's share the one
 * libgomp). Only code running on those threads can pin them; Python never does.
 */
#define _GNU_SOURCE
#include <sched.h>

#include "common.h"

/* Pin a team of n threads opened here: thread 0 to core `first` (to `rest` too where
 * first < 0), every other thread to the `n_rest` cores in `rest`. Returns the team's size
 * (OpenMP may give fewer than n), or -1 where some thread could not be pinned; the others
 * keep theirs (the caller then pins the whole team to all its cores). */
int ta_pin_team(int n, int first, const int *rest, int n_rest)
{
    int failed = 0, size = 1;
#pragma omp parallel num_threads(n) reduction(| : failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        if (team_thread() == 0)
            size = team_size();
        if (team_thread() == 0 && first >= 0) {
            CPU_SET(first, &set);
        } else {
            for (int i = 0; i < n_rest; i++)
                CPU_SET(rest[i], &set);
        }
        failed |= sched_setaffinity(0, sizeof set, &set) != 0;
    }
    return failed ? -1 : size;
}
