// The device code of `decodepack bench` itself, as PTX that the CUDA driver compiles for the GPU it runs
// on (cuModuleLoadDataEx): the tool links no toolkit library and needs no compiler on the GPU host.
// tests/bench/check_ptx.py assembles it with ptxas for sm_90a where a toolkit is installed.
//
//   dp_bench_read(src, n16, sink, magic)   a read-only stream: the grid's threads read the n16 16-byte
//       vectors of src (thread i reads i, i + T, i + 2T, ..., T = threads in the grid), four
//       non-coherent (ld.global.nc) loads in flight per loop trip, and XOR everything they read; a
//       thread stores its XOR to *sink only when it equals `magic` (never in practice), so that no load
//       can be optimised away and nothing is written. The HBM read ceiling, and, over a buffer a few
//       times the L2, the L2 flush before a kernel timed alone.
//   dp_bench_empty()                       does nothing: the cost of a dependent launch.
#pragma once

namespace dp::tools {

inline constexpr const char* kBenchPtx = R"PTX(
.version 7.0
.target sm_70
.address_size 64

.visible .entry dp_bench_read(
    .param .u64 dp_bench_read_src,
    .param .u64 dp_bench_read_n16,
    .param .u64 dp_bench_read_sink,
    .param .u32 dp_bench_read_magic
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<32>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [dp_bench_read_src];
    ld.param.u64 %rd2, [dp_bench_read_n16];
    ld.param.u64 %rd3, [dp_bench_read_sink];
    ld.param.u32 %r1, [dp_bench_read_magic];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;

    // i = ctaid.x * ntid.x + tid.x;  T = nctaid.x * ntid.x
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %nctaid.x;
    mul.wide.u32 %rd4, %r2, %r3;
    cvt.u64.u32 %rd5, %r4;
    add.u64 %rd4, %rd4, %rd5;
    mul.wide.u32 %rd6, %r5, %r3;
    mul.lo.u64 %rd7, %rd6, 3;       // 3T
    shl.b64 %rd8, %rd6, 2;          // 4T
    shl.b64 %rd9, %rd6, 4;          // 16T: bytes between a thread's consecutive vectors
    mov.u32 %r6, 0;

$Lread4:
    add.u64 %rd10, %rd4, %rd7;      // i + 3T
    setp.ge.u64 %p1, %rd10, %rd2;
    @%p1 bra $Lread1;
    shl.b64 %rd11, %rd4, 4;
    add.u64 %rd11, %rd1, %rd11;
    add.u64 %rd12, %rd11, %rd9;
    add.u64 %rd13, %rd12, %rd9;
    add.u64 %rd14, %rd13, %rd9;
    ld.global.nc.v4.u32 {%r8, %r9, %r10, %r11}, [%rd11];
    ld.global.nc.v4.u32 {%r12, %r13, %r14, %r15}, [%rd12];
    ld.global.nc.v4.u32 {%r16, %r17, %r18, %r19}, [%rd13];
    ld.global.nc.v4.u32 {%r20, %r21, %r22, %r23}, [%rd14];
    xor.b32 %r8, %r8, %r9;
    xor.b32 %r10, %r10, %r11;
    xor.b32 %r12, %r12, %r13;
    xor.b32 %r14, %r14, %r15;
    xor.b32 %r16, %r16, %r17;
    xor.b32 %r18, %r18, %r19;
    xor.b32 %r20, %r20, %r21;
    xor.b32 %r22, %r22, %r23;
    xor.b32 %r8, %r8, %r10;
    xor.b32 %r12, %r12, %r14;
    xor.b32 %r16, %r16, %r18;
    xor.b32 %r20, %r20, %r22;
    xor.b32 %r8, %r8, %r12;
    xor.b32 %r16, %r16, %r20;
    xor.b32 %r8, %r8, %r16;
    xor.b32 %r6, %r6, %r8;
    add.u64 %rd4, %rd4, %rd8;
    bra.uni $Lread4;

$Lread1:
    setp.ge.u64 %p2, %rd4, %rd2;
    @%p2 bra $Ldone;
    shl.b64 %rd11, %rd4, 4;
    add.u64 %rd11, %rd1, %rd11;
    ld.global.nc.v4.u32 {%r8, %r9, %r10, %r11}, [%rd11];
    xor.b32 %r8, %r8, %r9;
    xor.b32 %r10, %r10, %r11;
    xor.b32 %r8, %r8, %r10;
    xor.b32 %r6, %r6, %r8;
    add.u64 %rd4, %rd4, %rd6;
    bra.uni $Lread1;

$Ldone:
    setp.ne.u32 %p3, %r6, %r1;
    @%p3 bra $Lend;
    st.global.u32 [%rd3], %r6;
$Lend:
    ret;
}

.visible .entry dp_bench_empty()
{
    ret;
}
)PTX";

}  // namespace dp::tools
