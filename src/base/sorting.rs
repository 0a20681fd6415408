//! One sort for the whole module, for the sorts off the per-request scoring path.
//!
//! Every `sort`/`sort_by` of another element type or closure makes the compiler emit its own copy
//! of the standard library's sort (driftsort or ipnsort with their small-sort networks): measured
//! on the release `.wasm`, 106 such functions, 117 KB, a tenth of the module. [`sort_by`] orders
//! an index permutation with ONE non-generic routine ([`order`], a comparator behind `dyn`) and
//! then moves the elements into that order, so the binary holds one copy of the sort whatever
//! the types. It is stable (ties keep their order: the index breaks them), allocates two
//! `Vec`s of the slice's length, and costs an indirect call per comparison: right for the short,
//! occasional sorts here (flow-control levels, health records, pod lists), not for the scorer.
//!
//! No panic: the permutation is of `0..len`, read with `get`.

use std::cmp::Ordering;

/// The stable order of `0..n` under `cmp`: the one instantiation of the standard sort.
#[inline(never)]
fn order(n: usize, cmp: &mut dyn FnMut(usize, usize) -> Ordering) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_unstable_by(|&a, &b| cmp(a, b).then(a.cmp(&b)));
    idx
}

/// Sorts `v` by `cmp`, stably (as `slice::sort_by`).
pub fn sort_by<T>(v: &mut Vec<T>, mut cmp: impl FnMut(&T, &T) -> Ordering) {
    if v.len() < 2 {
        return;
    }
    let perm = {
        let s: &[T] = v;
        order(s.len(), &mut |a, b| match (s.get(a), s.get(b)) {
            (Some(x), Some(y)) => cmp(x, y),
            _ => Ordering::Equal,
        })
    };
    let mut slots: Vec<Option<T>> = v.drain(..).map(Some).collect();
    v.extend(perm.into_iter().filter_map(|i| slots.get_mut(i).and_then(Option::take)));
}

/// Sorts `v` in ascending order, stably (as `slice::sort`).
pub fn sort<T: Ord>(v: &mut Vec<T>) {
    sort_by(v, T::cmp);
}

/// Sorts `v` by `key`, stably (as `slice::sort_by_key`).
pub fn sort_by_key<T, K: Ord>(v: &mut Vec<T>, mut key: impl FnMut(&T) -> K) {
    sort_by(v, |a, b| key(a).cmp(&key(b)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn same_as_the_standard_stable_sort(v in proptest::collection::vec((0u8..8, any::<u16>()), 0..200)) {
            // Sorting by the first field only: ties must keep their order, as the standard stable sort.
            let mut ours = v.clone();
            sort_by_key(&mut ours, |p| p.0);
            let mut std_sorted = v.clone();
            std_sorted.sort_by_key(|p| p.0);
            prop_assert_eq!(&ours, &std_sorted);
            let mut full = v.clone();
            sort(&mut full);
            let mut expected = v;
            expected.sort();
            prop_assert_eq!(full, expected);
        }
    }

    #[test]
    fn strings_and_descending_order() {
        let mut v = vec!["b".to_string(), "c".to_string(), "a".to_string()];
        sort(&mut v);
        assert_eq!(v, ["a", "b", "c"]);
        sort_by(&mut v, |a, b| b.cmp(a));
        assert_eq!(v, ["c", "b", "a"]);
        let mut empty: Vec<u32> = Vec::new();
        sort(&mut empty);
        assert!(empty.is_empty());
    }
}
