//! Element-wise reduce kernels: `acc = acc ⊕ x` over little-endian numeric arrays.
//!
//! The loops are plain slice zips over aligned typed slices, which LLVM vectorises (checked
//! with the `reduce_kernels` bench against a byte-wise scalar loop).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    Sum,
    Min,
    Max,
    Prod,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    F32,
    F64,
    I32,
    I64,
    U8,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::U8 => 1,
        }
    }
}

trait Elem: bytemuck::Pod {
    fn sum(a: Self, b: Self) -> Self;
    fn prod(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn from_le(b: &[u8]) -> Self;
    fn write_le(self, b: &mut [u8]);
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            // Integers wrap, as MPI_SUM does in practice: never a panic on overflow.
            fn sum(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            fn prod(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            fn min(a: Self, b: Self) -> Self { Ord::min(a, b) }
            fn max(a: Self, b: Self) -> Self { Ord::max(a, b) }
            fn from_le(b: &[u8]) -> Self { <$t>::from_le_bytes(b.try_into().expect("element")) }
            fn write_le(self, b: &mut [u8]) { b.copy_from_slice(&self.to_le_bytes()) }
        }
    )*};
}
int_elem!(i32, i64, u8);

macro_rules! float_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            fn sum(a: Self, b: Self) -> Self { a + b }
            fn prod(a: Self, b: Self) -> Self { a * b }
            fn min(a: Self, b: Self) -> Self { if b < a { b } else { a } }
            fn max(a: Self, b: Self) -> Self { if b > a { b } else { a } }
            fn from_le(b: &[u8]) -> Self { <$t>::from_le_bytes(b.try_into().expect("element")) }
            fn write_le(self, b: &mut [u8]) { b.copy_from_slice(&self.to_le_bytes()) }
        }
    )*};
}
float_elem!(f32, f64);

#[inline]
fn apply<T: Elem>(op: ReduceOp, acc: &mut [T], x: &[T]) {
    // One monomorphic loop per op so each vectorises on its own.
    match op {
        ReduceOp::Sum => acc.iter_mut().zip(x).for_each(|(a, &b)| *a = T::sum(*a, b)),
        ReduceOp::Prod => acc
            .iter_mut()
            .zip(x)
            .for_each(|(a, &b)| *a = T::prod(*a, b)),
        ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, &b)| *a = T::min(*a, b)),
        ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, &b)| *a = T::max(*a, b)),
    }
}

fn combine_typed<T: Elem>(op: ReduceOp, acc: &mut [u8], x: &[u8]) {
    let sz = std::mem::size_of::<T>();
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(acc),
        bytemuck::try_cast_slice::<u8, T>(x),
    ) {
        (Ok(a), Ok(b)) => apply(op, a, b),
        // Unaligned input (an inline object in a Vec<u8>): element by element.
        _ => {
            let f = match op {
                ReduceOp::Sum => T::sum,
                ReduceOp::Prod => T::prod,
                ReduceOp::Min => T::min,
                ReduceOp::Max => T::max,
            };
            for (a, b) in acc.chunks_exact_mut(sz).zip(x.chunks_exact(sz)) {
                f(T::from_le(a), T::from_le(b)).write_le(a);
            }
        }
    }
}

/// `acc[i] = acc[i] ⊕ x[i]` for every element. Both lengths must be equal multiples of the
/// element size (the caller checks object sizes up front).
pub fn combine(op: ReduceOp, dtype: DType, acc: &mut [u8], x: &[u8]) {
    assert_eq!(acc.len(), x.len(), "combine of unequal lengths");
    assert_eq!(acc.len() % dtype.size(), 0, "partial element");
    match dtype {
        DType::F32 => combine_typed::<f32>(op, acc, x),
        DType::F64 => combine_typed::<f64>(op, acc, x),
        DType::I32 => combine_typed::<i32>(op, acc, x),
        DType::I64 => combine_typed::<i64>(op, acc, x),
        DType::U8 => combine_typed::<u8>(op, acc, x),
    }
}

#[inline]
fn apply_into<T: Elem>(op: ReduceOp, out: &mut [T], a: &[T], b: &[T]) {
    // One monomorphic loop per op (a function pointer here would block vectorisation).
    let pairs = out.iter_mut().zip(a.iter().zip(b));
    match op {
        ReduceOp::Sum => pairs.for_each(|(o, (&x, &y))| *o = T::sum(x, y)),
        ReduceOp::Prod => pairs.for_each(|(o, (&x, &y))| *o = T::prod(x, y)),
        ReduceOp::Min => pairs.for_each(|(o, (&x, &y))| *o = T::min(x, y)),
        ReduceOp::Max => pairs.for_each(|(o, (&x, &y))| *o = T::max(x, y)),
    }
}

fn combine_into_typed<T: Elem>(op: ReduceOp, out: &mut [u8], a: &[u8], b: &[u8]) {
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(out),
        bytemuck::try_cast_slice::<u8, T>(a),
        bytemuck::try_cast_slice::<u8, T>(b),
    ) {
        (Ok(o), Ok(x), Ok(y)) => apply_into(op, o, x, y),
        (_, _, _) => {
            out.copy_from_slice(a);
            combine_typed::<T>(op, out, b);
        }
    }
}

/// `out[i] = a[i] ⊕ b[i]`: one pass instead of a copy and a combine.
pub fn combine_into(op: ReduceOp, dtype: DType, out: &mut [u8], a: &[u8], b: &[u8]) {
    assert!(
        out.len() == a.len() && a.len() == b.len(),
        "combine of unequal lengths"
    );
    assert_eq!(out.len() % dtype.size(), 0, "partial element");
    match dtype {
        DType::F32 => combine_into_typed::<f32>(op, out, a, b),
        DType::F64 => combine_into_typed::<f64>(op, out, a, b),
        DType::I32 => combine_into_typed::<i32>(op, out, a, b),
        DType::I64 => combine_into_typed::<i64>(op, out, a, b),
        DType::U8 => combine_into_typed::<u8>(op, out, a, b),
    }
}

/// Byte-wise reference kernel (no typed slices): the scalar baseline for the kernel bench.
pub fn combine_scalar(op: ReduceOp, dtype: DType, acc: &mut [u8], x: &[u8]) {
    macro_rules! go {
        ($t:ty) => {{
            let f = match op {
                ReduceOp::Sum => <$t as Elem>::sum,
                ReduceOp::Prod => <$t as Elem>::prod,
                ReduceOp::Min => <$t as Elem>::min,
                ReduceOp::Max => <$t as Elem>::max,
            };
            let sz = std::mem::size_of::<$t>();
            for (a, b) in acc.chunks_exact_mut(sz).zip(x.chunks_exact(sz)) {
                f(<$t as Elem>::from_le(a), <$t as Elem>::from_le(b)).write_le(a);
            }
        }};
    }
    match dtype {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::I32 => go!(i32),
        DType::I64 => go!(i64),
        DType::U8 => go!(u8),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_and_scalar_agree() {
        for dtype in [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8] {
            for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod] {
                let mut a: Vec<u64> = (0..64).map(|i| i * 0x0101_0101 + 3).collect();
                let b: Vec<u64> = (0..64).map(|i| (i * 7919) ^ 0x0202_0202).collect();
                let mut a2 = a.clone();
                combine(
                    op,
                    dtype,
                    bytemuck::cast_slice_mut(&mut a),
                    bytemuck::cast_slice(&b),
                );
                combine_scalar(
                    op,
                    dtype,
                    bytemuck::cast_slice_mut(&mut a2),
                    bytemuck::cast_slice(&b),
                );
                assert_eq!(
                    bytemuck::cast_slice::<u64, u8>(&a),
                    bytemuck::cast_slice::<u64, u8>(&a2),
                    "{op:?} {dtype:?}"
                );
            }
        }
    }

    #[test]
    fn combine_into_equals_copy_then_combine() {
        for dtype in [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8] {
            for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod] {
                let a: Vec<u64> = (0..64).map(|i| i * 0x0101_0101 + 3).collect();
                let b: Vec<u64> = (0..64).map(|i| (i * 7919) ^ 0x0202_0202).collect();
                let mut want = a.clone();
                combine(
                    op,
                    dtype,
                    bytemuck::cast_slice_mut(&mut want),
                    bytemuck::cast_slice(&b),
                );
                let mut out = vec![0u64; 64];
                combine_into(
                    op,
                    dtype,
                    bytemuck::cast_slice_mut(&mut out),
                    bytemuck::cast_slice(&a),
                    bytemuck::cast_slice(&b),
                );
                assert_eq!(out, want, "{op:?} {dtype:?}");
            }
        }
    }

    #[test]
    fn unaligned_inputs_work() {
        let mut acc = [0u8; 17];
        let mut x = [0u8; 17];
        acc[1..5].copy_from_slice(&1.5f32.to_le_bytes());
        x[1..5].copy_from_slice(&2.0f32.to_le_bytes());
        combine(ReduceOp::Sum, DType::F32, &mut acc[1..5], &x[1..5]);
        assert_eq!(f32::from_le_bytes(acc[1..5].try_into().unwrap()), 3.5);
        let mut acc = [200u8, 5];
        combine(ReduceOp::Sum, DType::U8, &mut acc, &[100, 6]);
        assert_eq!(acc, [44, 11], "wrapping");
    }
}
