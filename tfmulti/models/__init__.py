"""Models: the built-in ones and the one build() above them (zoo.py), and yours
(usermodel.py: --model=MODULE:FUNCTION)."""
