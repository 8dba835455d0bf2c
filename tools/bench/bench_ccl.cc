/* oneCCL's allreduce against MPI_Allreduce for the tensor-parallel sum (float32, one layer's partial
 * products of dim x rows), timed back to back in the same ranks, alternating call by call. The oneCCL
 * communicator is bootstrapped over MPI as xFasterTransformer does: rank 0 creates the main KVS and
 * broadcasts its address with MPI_Bcast. Not part of corelm; docs/benchmarks.md has the results.
 *
 * Build (venv with `pip install mpich` and `pip install --no-deps oneccl-cpu oneccl-cpu-devel`; the
 * oneccl-cpu 2022.2.0 wheel lacks the libccl.so.2 its libccl.so.1 needs: copy it from the `oneccl` wheel
 * of the same version into $VENV/lib):
 *   VENV=/work/venv
 *   $VENV/bin/mpicxx -O2 -std=c++17 -I$VENV/include tools/bench/bench_ccl.cc -o /tmp/bench_ccl \
 *       -L$VENV/lib -lccl -Wl,-rpath,$VENV/lib
 * Run (2 ranks; MPI over TCP loopback: MPIR_CVAR_NOLOCAL=1 UCX_TLS=tcp FI_PROVIDER=tcp; oneCCL's
 * transport: CCL_ATL_TRANSPORT=ofi|mpi, FI_PROVIDER, CCL_ATL_SHM=1):
 *   $VENV/bin/mpiexec -n 2 /tmp/bench_ccl [--dims 896 1536] [--rows 1 16 128] [--iters 2000]
 * Prints one line per shape: dim rows, then the median microseconds per call of MPI and oneCCL on rank 0.
 */
#include <mpi.h>

#include <oneapi/ccl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static double median(std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static std::vector<int> int_list(int& i, int argc, char** argv) {
    std::vector<int> out;
    while (i + 1 < argc && argv[i + 1][0] != '-') out.push_back(std::atoi(argv[++i]));
    return out;
}

// Times both allreduces over every shape; returns how many calls gave a wrong sum on this rank.
static int measure(int rank, int size, const std::vector<int>& dims, const std::vector<int>& rows, int iters) {
    int bad = 0;
    ccl::shared_ptr_class<ccl::kvs> kvs;
    ccl::kvs::address_type addr;
    if (rank == 0) {
        kvs = ccl::create_main_kvs();
        addr = kvs->get_address();
        MPI_Bcast(addr.data(), (int)addr.size(), MPI_BYTE, 0, MPI_COMM_WORLD);
    } else {
        MPI_Bcast(addr.data(), (int)addr.size(), MPI_BYTE, 0, MPI_COMM_WORLD);
        kvs = ccl::create_kvs(addr);
    }
    auto comm = ccl::create_communicator(size, rank, kvs);

    using clock = std::chrono::steady_clock;
    const float expect = size * (size + 1) / 2.0f;   // rank r contributes r + 1
    for (int d : dims) {
        for (int r : rows) {
            size_t n = (size_t)d * r;
            std::vector<float> buf(n);
            int k = std::max(20, iters / std::max(1, r / 16));
            std::vector<double> t_mpi, t_ccl;
            t_mpi.reserve(k);
            t_ccl.reserve(k);
            MPI_Barrier(MPI_COMM_WORLD);
            // alternate call by call; the first 10 of each are warm-up and not counted
            for (int it = 0; it < k + 10; it++) {
                for (int which = 0; which < 2; which++) {
                    // a fresh partial sum each call, in cache as a GEMM would leave it
                    std::fill(buf.begin(), buf.end(), (float)(rank + 1));
                    auto t0 = clock::now();
                    if (which == 0)
                        MPI_Allreduce(MPI_IN_PLACE, buf.data(), (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                    else
                        ccl::allreduce(buf.data(), buf.data(), n, ccl::reduction::sum, comm).wait();
                    double us = std::chrono::duration<double, std::micro>(clock::now() - t0).count();
                    if (buf[0] != expect || buf[n - 1] != expect) bad++;
                    if (it >= 10) (which == 0 ? t_mpi : t_ccl).push_back(us);
                }
            }
            if (rank == 0)
                std::printf("%5d %5d %9.1f %9.1f\n", d, r, median(t_mpi), median(t_ccl)), std::fflush(stdout);
        }
    }
    return bad;
}

int main(int argc, char** argv) {
    std::vector<int> dims{896, 1536}, rows{1, 16, 128};
    int iters = 2000;
    for (int i = 1; i < argc; i++) {
        if (!std::strcmp(argv[i], "--dims")) dims = int_list(i, argc, argv);
        else if (!std::strcmp(argv[i], "--rows")) rows = int_list(i, argc, argv);
        else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
        else { std::fprintf(stderr, "usage: %s [--dims D...] [--rows R...] [--iters N]\n", argv[0]); return 2; }
    }
    // oneCCL's worker threads and MPI transport call MPI from other threads (corelm asks mpi4py for the same)
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);

    ccl::init();
    // oneCCL's objects are gone by MPI_Finalize: its MPI transport calls MPI as they are destroyed
    int bad = measure(rank, size, dims, rows, iters);
    int bad_all = 0;
    MPI_Allreduce(&bad, &bad_all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0 && bad_all) std::fprintf(stderr, "wrong sums: %d\n", bad_all);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
    return bad_all ? 1 : 0;
}
