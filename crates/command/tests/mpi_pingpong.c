/* A 2-rank MPI ping-pong for emu_mpi.rs: rank 0 sends a patterned buffer, rank 1 checks every
 * byte, adds one to each and sends it back, rank 0 checks every byte; 8 B, 4 KiB, 64 KiB and
 * 1 MiB, 50 round trips each. Rank 0 prints "pingpong ok" at the end; a wrong byte aborts. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (n != 2) {
        if (rank == 0) printf("needs 2 ranks, has %d\n", n);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    const size_t sizes[] = {8, 4096, 65536, 1 << 20};
    for (size_t s = 0; s < 4; s++) {
        size_t len = sizes[s];
        unsigned char *b = malloc(len);
        if (!b) MPI_Abort(MPI_COMM_WORLD, 1);
        for (int it = 0; it < 50; it++) {
            if (rank == 0) {
                for (size_t i = 0; i < len; i++) b[i] = (unsigned char)(i * 7 + it + s);
                MPI_Send(b, (int)len, MPI_BYTE, 1, it, MPI_COMM_WORLD);
                memset(b, 0, len);
                MPI_Recv(b, (int)len, MPI_BYTE, 1, it, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                for (size_t i = 0; i < len; i++)
                    if (b[i] != (unsigned char)(i * 7 + it + s + 1)) {
                        printf("rank 0: byte %zu of %zu wrong\n", i, len);
                        MPI_Abort(MPI_COMM_WORLD, 2);
                    }
            } else {
                MPI_Recv(b, (int)len, MPI_BYTE, 0, it, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                for (size_t i = 0; i < len; i++)
                    if (b[i] != (unsigned char)(i * 7 + it + s)) {
                        printf("rank 1: byte %zu of %zu wrong\n", i, len);
                        MPI_Abort(MPI_COMM_WORLD, 2);
                    }
                for (size_t i = 0; i < len; i++) b[i]++;
                MPI_Send(b, (int)len, MPI_BYTE, 0, it, MPI_COMM_WORLD);
            }
        }
        free(b);
    }
    if (rank == 0) printf("pingpong ok: 4 sizes x 50 round trips, every byte checked\n");
    MPI_Finalize();
    return 0;
}
