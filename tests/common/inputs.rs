//! Inputs for reduce tests, shared by the test files that `#[path]` this module in.

use phalanx::DType;

/// Input `k` of `size` bytes of `dtype`: elements with values 0..=3, different per input
/// (exact in every dtype and op, so no order of combination can change a bit).
pub fn input(k: usize, size: u64, dtype: DType) -> Vec<u8> {
    let esz = dtype.size();
    let mut v = vec![0u8; size as usize];
    for (i, e) in v.chunks_mut(esz).enumerate() {
        let x = ((i * 7 + k * 3) % 4) as u8;
        match dtype {
            DType::F32 => e.copy_from_slice(&(x as f32).to_le_bytes()),
            DType::F64 => e.copy_from_slice(&(x as f64).to_le_bytes()),
            DType::I32 => e.copy_from_slice(&(x as i32).to_le_bytes()),
            DType::I64 => e.copy_from_slice(&(x as i64).to_le_bytes()),
            DType::U8 => e[0] = x,
        }
    }
    v
}
