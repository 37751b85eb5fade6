//! Division by a divisor the host knows, as a kernel does it cheaply: a multiply-high and a shift
//! (`__umulhi(n, magic) >> shift`) in place of an integer division, which the GPU has no
//! instruction for (each one is a sequence of some twenty instructions, and in an unrolled loop
//! a good part of the compile time).

/// (magic, shift) such that `n / d == umulhi(n, magic) >> shift` for every `n < 2^31`
/// (`d` in 1..2^31; magic 0 stands for d = 1, which the kernel does not divide by).
pub fn divider(d: usize) -> (u32, u32) {
    if d <= 1 {
        return (0, 0);
    }
    let log = usize::BITS - (d - 1).leading_zeros(); // ceil(log2 d)
    let p = 31 + log;
    let magic = (1u64 << p).div_ceil(d as u64);
    (magic as u32, log - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divider_matches_division_below_2_pow_31() {
        let mut divisors: Vec<usize> = (1..=300).collect();
        divisors.extend([
            588,
            592,
            768,
            1000,
            (1 << 16) - 1,
            1 << 16,
            (1 << 16) + 1,
            12345,
            (1 << 30) + 1,
            (1 << 31) - 1,
        ]);
        let mut dividends: Vec<u32> = (0..2000).collect();
        for k in 1..31 {
            for off in [-1i64, 0, 1] {
                dividends.push(((1i64 << k) + off) as u32);
            }
        }
        dividends.extend([i32::MAX as u32, i32::MAX as u32 - 1, 1_999_999_999]);
        for &d in &divisors {
            let (magic, shift) = divider(d);
            for &n in &dividends {
                let got = if magic == 0 {
                    n
                } else {
                    (((n as u64 * magic as u64) >> 32) as u32) >> shift
                };
                assert_eq!(got as usize, n as usize / d, "{n} / {d}");
            }
        }
    }
}
