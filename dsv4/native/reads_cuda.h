// EngramRows on CUDA (included inside reads.cpp's namespace, after its Table, when MLX runs on CUDA
// and CUDA's headers are there: -DDSV4_CUDA, dsv4/native/__init__.py):
// the reads run as a host function in the step's own stream, so the device waits for them as for
// any node of the step's graph, and the host never does. A CPU stream cannot do this on CUDA: each
// of its events allocates and frees managed memory, which waits for the device while the device
// waits for the reads (dsv4/engram_queued.py).
//
//   ids (device memory) --memcpy--> a copy in unified memory --host function: Table::read-->
//   rows and status, in unified memory
//
// Both are captured from the stream into one child graph node. The driver's functions come from
// libcuda, which MLX has loaded; nothing links the CUDA runtime.

namespace cuda_reads {

struct Driver {
  CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*launch_host_func)(CUstream, CUhostFn, void*);

  static const Driver& get() {
    static const Driver driver = [] {
      void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
      Driver d{};
      if (lib) {
        d.memcpy_async = reinterpret_cast<decltype(d.memcpy_async)>(dlsym(lib, "cuMemcpyAsync"));
        d.launch_host_func = reinterpret_cast<decltype(d.launch_host_func)>(dlsym(lib, "cuLaunchHostFunc"));
      }
      return d;
    }();
    if (!driver.memcpy_async || !driver.launch_host_func)
      throw std::runtime_error("[EngramRows] libcuda.so.1's cuMemcpyAsync/cuLaunchHostFunc not found");
    return driver;
  }
};

// What one call's host function reads; it lives until the stream has run it.
struct Job {
  std::shared_ptr<const Table> table;
  const int64_t* ids;
  int64_t n;
  uint8_t* rows;
  int64_t* status;
};

void CUDA_CB run_job(void* job) {
  auto* j = static_cast<Job*>(job);
  j->table->read(j->ids, j->n, j->rows, j->status);
}

void check(CUresult result, const char* what, mx::cu::CommandEncoder::CaptureContext& capture) {
  if (result == CUDA_SUCCESS) return;
  capture.discard = true;
  throw std::runtime_error(std::string("[EngramRows] ") + what + " failed: CUresult " + std::to_string(result));
}

void eval(const std::shared_ptr<const Table>& table, mx::Stream stream, const mx::array& ids, mx::array& rows,
          mx::array& status) {
  const Driver& driver = Driver::get();
  auto& encoder = mx::cu::get_command_encoder(stream);
  // Unified memory (MLX's allocator::malloc on CUDA): the host function writes the outputs in place.
  rows.set_data(mx::allocator::malloc(rows.nbytes()));
  status.set_data(mx::allocator::malloc(status.nbytes()));
  mx::array staged(ids.shape(), mx::int64, nullptr, {});
  staged.set_data(mx::allocator::malloc(ids.nbytes()));
  encoder.set_input_array(ids);
  encoder.set_output_array(rows);
  encoder.set_output_array(status);
  encoder.add_temporary(staged);
  auto job = std::make_shared<Job>(Job{table, mx::gpu_ptr<int64_t>(staged), static_cast<int64_t>(ids.size()),
                                       mx::gpu_ptr<uint8_t>(rows), mx::gpu_ptr<int64_t>(status)});
  {
    auto capture = encoder.capture_context();
    CUstream s = encoder.stream();
    check(driver.memcpy_async(reinterpret_cast<CUdeviceptr>(job->ids),
                              reinterpret_cast<CUdeviceptr>(mx::gpu_ptr<void>(ids)), ids.nbytes(), s),
          "cuMemcpyAsync", capture);
    check(driver.launch_host_func(s, run_job, job.get()), "cuLaunchHostFunc", capture);
  }
  encoder.add_completed_handler([job] {});   // the job outlives the host function's run
}

}  // namespace cuda_reads
