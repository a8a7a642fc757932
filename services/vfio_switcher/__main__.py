from services.vfio_switcher.service import main

main()
