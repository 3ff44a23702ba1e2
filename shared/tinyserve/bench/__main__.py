"""``python -m tinyserve.bench kernels|crossover|sim`` (also ``tinyserve bench ...``)."""

from tinyserve.bench import main

main()
