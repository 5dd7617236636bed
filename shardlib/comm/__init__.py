"""Layer 2, communication: collectives with byte accounting (``core``), redistribution plans
between layouts and their execution (``redistribute``), autograd-aware named collectives
(``autograd``, ``collectives``, ``vma``) and DTensor interop (``interop``)."""
