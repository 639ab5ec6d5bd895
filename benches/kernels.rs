//! Reduce kernels: the typed (vectorised) loop against a byte-wise scalar loop, 16 MiB.
//! `cargo bench --bench kernels`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use phalanx::ops::{combine, combine_into, combine_scalar};
use phalanx::{DType, ReduceOp};

fn kernels(c: &mut Criterion) {
    const N: usize = 16 << 20;
    // u64 backing keeps the byte buffers aligned for every element type.
    let a: Vec<u64> = (0..N as u64 / 8)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) & 0x3f3f_3f3f_3f3f_3f3f)
        .collect();
    let b: Vec<u64> = a
        .iter()
        .map(|x| x.rotate_left(7) & 0x3f3f_3f3f_3f3f_3f3f)
        .collect();
    let mut acc = a.clone();
    let mut g = c.benchmark_group("combine_16MiB");
    g.throughput(Throughput::Bytes(N as u64));
    g.sample_size(20);
    for dtype in [DType::F32, DType::I64] {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let name = format!("{op:?}-{dtype:?}");
            g.bench_function(BenchmarkId::new("typed", &name), |bch| {
                bch.iter(|| {
                    combine(
                        op,
                        dtype,
                        bytemuck::cast_slice_mut(&mut acc),
                        bytemuck::cast_slice(&b),
                    )
                })
            });
            g.bench_function(BenchmarkId::new("typed_into", &name), |bch| {
                bch.iter(|| {
                    combine_into(
                        op,
                        dtype,
                        bytemuck::cast_slice_mut(&mut acc),
                        bytemuck::cast_slice(&a),
                        bytemuck::cast_slice(&b),
                    )
                })
            });
            g.bench_function(BenchmarkId::new("scalar", &name), |bch| {
                bch.iter(|| {
                    combine_scalar(
                        op,
                        dtype,
                        bytemuck::cast_slice_mut(&mut acc),
                        bytemuck::cast_slice(&b),
                    )
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
