import unittest

from maxlist import largest


class TestLargest(unittest.TestCase):
    def test_last_is_largest(self):
        self.assertEqual(largest([1, 2, 9]), 9)

    def test_first_is_largest(self):
        self.assertEqual(largest([7, 2, 3]), 7)


if __name__ == "__main__":
    unittest.main()
